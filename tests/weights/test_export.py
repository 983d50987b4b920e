"""``export_model``: RUN_DIR/model loads back with transformers / peft / load_gpt and computes the trained model."""

from __future__ import annotations

import json

import pytest
import torch

from trainfit.config import make_config
from trainfit.export import export_model, load_gpt
from trainfit.levers.finetune import merged_state_dict
from trainfit.run import build_run

from .conftest import GPT

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")


def _trained(tmp_path, steps=3, **kw):
    cfg = make_config(dict(seq_len=16, micro_batch=2, accumulation=1, lr=0.05, run_dir=str(tmp_path / "run"), **kw))
    run = build_run(cfg)
    batch = run.task.example_batch(2)
    for _ in range(steps):
        run.step([batch])
    return run, batch["input_ids"]


def test_hf_round_trip_single(tmp_path, llama_dir):
    run, ids = _trained(tmp_path, model=f"hf:{llama_dir}")
    out = export_model(run, tmp_path / "run" / "model")
    with torch.no_grad():
        want = run.model(input_ids=ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
    assert not torch.equal(want, transformers.AutoModelForCausalLM.from_pretrained(llama_dir)(input_ids=ids).logits)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_export_replaces_the_previous_one(tmp_path):
    run, _ = _trained(tmp_path, steps=1, model="gpt-tiny", model_config=GPT)
    out = tmp_path / "run" / "model"
    export_model(run, out)
    (out / "stale.txt").write_text("from the previous export")
    run.step([run.task.example_batch(2)])
    export_model(run, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []


def test_gpt_round_trip(tmp_path):
    run, ids = _trained(tmp_path, model="gpt-tiny", model_config=GPT)
    out = export_model(run, tmp_path / "run" / "model")
    assert json.loads((out / "config.json").read_text())["trainfit_model"] == "gpt-tiny"
    with torch.no_grad():
        torch.testing.assert_close(load_gpt(out)(ids), run.model(ids), atol=1e-6, rtol=0)


def test_half_precision_exports_the_fp32_masters(tmp_path, llama_dir):
    run, _ = _trained(tmp_path, model=f"hf:{llama_dir}", precision="bf16-true")
    out = export_model(run, tmp_path / "run" / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    masters = dict(zip(trainable, run.optimizer_params()))
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    sd = loaded.state_dict()
    for name, master in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], master.detach()), name
    assert any(not torch.equal(m.detach(), m.detach().bfloat16().float()) for m in masters.values())


def test_merged_lora_loads_with_from_pretrained(tmp_path, llama_dir):
    run, ids = _trained(tmp_path, model=f"hf:{llama_dir}", lora="r=4,alpha=8,targets=q_proj,v_proj,merge=true")
    out = export_model(run, tmp_path / "run" / "model")
    with torch.no_grad():
        want = run.model(input_ids=ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_merge_is_peft_merge_and_unload(llama_dir):
    """The pure merge against peft's own, on adapters with non-zero B."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(llama_dir),
                                peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "o_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    ours = merged_state_dict(model.state_dict(), 12 / 4)
    theirs = model.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-6, rtol=1e-6)


def test_lora_adapter_export_names_its_base(tmp_path, llama_dir):
    peft = pytest.importorskip("peft")
    run, ids = _trained(tmp_path, model=f"hf:{llama_dir}", lora="r=4,alpha=8,targets=q_proj,v_proj")
    out = export_model(run, tmp_path / "run" / "model")
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(llama_dir.resolve())
    assert not (out / "model.safetensors").exists()
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, run.model(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_the_tokenizer_travels_with_an_hf_export(tmp_path, llama_dir):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", "the", "cat", "sat"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        tmp_path / "tok")
    run, _ = _trained(tmp_path, steps=1, model=f"hf:{llama_dir}", tokenizer=str(tmp_path / "tok"))
    out = export_model(run, tmp_path / "run" / "model")
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded("the cat sat dog")["input_ids"] == [2, 3, 4, 0] and loaded.eos_token == "[EOS]"
