"""``trainfit plan``: choose precision, micro-batch, accumulation, checkpointing and strategy before running."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING

from trainfit.commands.report import save_and_report
from trainfit.config import dump_toml, make_config
from trainfit.errors import ConfigError, TrainfitError, check_unique_keys
from trainfit.integrations.export_plan import TOOLS, check_write_for, export_plan, runnable_strategies
from trainfit.integrations.read_config import plan_job, rank_note, read_from
from trainfit.meters.devices import (
    DEVICES,
    clock_facts,
    device_row,
    dtypes_of,
    find_device,
    measure_host_copy,
    measure_loopback,
)
from trainfit.plan.basis import OPTIMIZER_BYTES, analytic_basis
from trainfit.plan.clock import DeviceClock, clocked_links
from trainfit.plan.offload import OFFLOAD_CHOICES, offload_price
from trainfit.plan.rules import Context
from trainfit.plan.search import (
    CHECKPOINT_CHOICES,
    PRECISION_CHOICES,
    STRATEGY_CHOICES,
    SearchSpace,
    needed_pairs,
    search,
    step_floor,
)
from trainfit.outputs import check_output_file, check_run_dir, dumps_json
from trainfit.plan.shapes import PlannedModel, TransformerShape, parse_model_config, plan_model, run_spec
from trainfit.plan.trainable import trainable
from trainfit.presets import GPT_PRESETS, MODEL_HELP
from trainfit.probes.fastbasis import (
    BASIS_SOURCES,
    TRACED_AS,
    basis_provider,
    cache_dir,
    cache_key,
    check_task,
    links_provider,
    prefetch,
    read_record,
    write_record,
)
from trainfit.results import PlanReport, PlanRow
from trainfit.tasks.spec import DataSpec, check_model_fits
from trainfit.units import fmt_bytes, parse_bytes
from trainfit.vocabulary import (
    Dtype,
    EveryKthBlock,
    MemoryBudget,
    OffloadPart,
    PrecisionName,
    Optimizer,
    canonical_precision,
    precision_alias_note,
    SelectiveOps,
    choices,
    parse_checkpoint_policy,
    parse_lora,
    precision_facts,
    strategy_facts,
)

if TYPE_CHECKING:
    from trainfit.tasks.files import TextData


FILE_DATA_FLAGS = {
    "data": "plan for this training data (as train takes it): activations sized for the longest row it produces",
    "tokenizer": "byte or a directory holding a Hugging Face tokenizer.json "
                 "(default: the hf:DIR model's own, else the prepared data's, else byte)",
    "packing": "on (rows of seq_len tokens) or off (one document per row, the longest sets the size)",
    "text_field": "JSON Lines field / Parquet or CSV column holding the text (default text)",
    "text_errors": "bytes that are not UTF-8: strict (refuse) or replace (U+FFFD)",
}
"""The flags of ``--data`` jobs plan reads; None when not given (RunConfig's defaults then)."""


OFFLOAD_FLAG = {"none": "", "optimizer": "optimizer", "activations": "activations",
                "optimizer+activations": "activations,optimizer"}
"""``plan --offloads`` names -> ``SearchSpace.offloads`` settings (``plan.offload.OFFLOAD_CHOICES``); under zero3
"optimizer" runs as ``--offload optimizer,params``."""
assert sorted(OFFLOAD_FLAG.values()) == sorted(OFFLOAD_CHOICES)

FAST_DEFAULT_CHECKPOINTINGS = ("none", "full")
"""The checkpointing policies searched by default when the basis is traced (``--basis fast``)."""


def register(sub) -> None:
    p = sub.add_parser("plan", help="choose the levers for a job so it fits and runs fastest")
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--model-config", default="", help="key=value,... overrides")
    p.add_argument("--global-batch", help="samples per optimizer step over all devices (required unless --from "
                                          "sets a per-device batch)")
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="the job of a transformers TrainingArguments JSON, an accelerate config YAML or Lightning "
                        "Trainer arguments: global batch, devices, nodes (flags override it); says where its own "
                        "configuration ranks")
    p.add_argument("--seq", "--seq-len", dest="seq_len", default="64", help="sequence length in tokens")
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 80GiB")
    p.add_argument("--devices", help="total devices (default 1)")
    p.add_argument("--nodes", help="nodes the devices are spread over (default 1)")
    p.add_argument("--device", default="h100", help=f"the device to plan for: {choices(DEVICES)} (default h100)")
    p.add_argument("--bandwidth-intra", help="per-device bandwidth inside a node, e.g. 450GB/s")
    p.add_argument("--bandwidth-inter", help="per-device bandwidth between nodes, e.g. 50GB/s")
    p.add_argument("--optimizer", default=str(Optimizer.ADAMW), help=choices(Optimizer))
    p.add_argument("--lora", default="", help="plan for LoRA adapters as train takes them: r=8,alpha=16,"
                                              "targets=q_proj,v_proj (only the adapters train)")
    p.add_argument("--freeze", default="", help="comma-separated glob patterns of parameter names frozen, as train "
                                                "takes them (no gradients, no optimizer state)")
    for key, help_text in FILE_DATA_FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, help=help_text)
    p.add_argument("--headroom", default="0.1", help="share of device memory kept free (default 0.1)")
    p.add_argument("--basis", default="auto", help="auto, analytic, estimate or measure: where the parts come from")
    p.add_argument("--calibrate", action="store_true",
                   help="cpu only: fit the compute rate to a few measured steps of this model (seconds); with "
                        "--devices > 1 also the distributed overhead, measured on 2 gloo processes (~1 min)")
    p.add_argument("--compile-speedup", metavar="F|measure",
                   help="add torch.compile (per block) to the search, its compute priced at F times the eager "
                        "step's speed (a ratio you measured, e.g. with `trainfit profile --compile on` on the "
                        "device), or `measure` (cpu): eager and compiled steps of this model, interleaved "
                        "(a compile per (precision, checkpointing) pair: minutes when inductor's cache is cold)")
    p.add_argument("--precisions", help=f"comma-separated subset of {', '.join(PRECISION_CHOICES)} (default: all)")
    p.add_argument("--checkpointings", help=f"comma-separated subset of {', '.join(CHECKPOINT_CHOICES)}, or every:K, "
                                            "selective, budget:F (default: none, every:2, full; none, full for a traced basis)")
    p.add_argument("--offloads", help="comma-separated subset of " + ", ".join(OFFLOAD_FLAG)
                   + ": what the search may keep in host memory, each priced at the host link (default: all of them "
                     "where the device row has a host link or --calibrate measures one on cpu; none otherwise)")
    p.add_argument("--strategies", help=f"comma-separated subset of {', '.join(STRATEGY_CHOICES)} (default: all)")
    p.add_argument("--top", default="10", help="entries to show")
    p.add_argument("--explain", metavar="N", help="break row N's step into compute-bound, memory-bound, recompute, "
                                                  "exposed communication and fixed cost (and in --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--report", action="store_true", help="also save RUN_DIR/plan.json and write RUN_DIR/report.html")
    p.add_argument("--run-dir", default="runs/default", help="where --report writes (default runs/default)")
    p.add_argument("--write", metavar="PLAN.toml", help="write the best plan as a config `trainfit train` runs")
    p.add_argument("--write-for", nargs=2, metavar=("TOOL", "FILE"),
                   help=f"write the best plan as {choices(TOOLS)}'s own configuration (TrainingArguments JSON, "
                        "accelerate config YAML, Lightning Trainer/Fabric JSON); prints what the tool cannot express")
    p.add_argument("--force", action="store_true", help="let --write / --write-for replace an existing file")
    p.set_defaults(func=run)


def _int(name: str, text: str, minimum: int = 1) -> int:
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise ConfigError(name, text, f"an integer >= {minimum}") from None
    if v < minimum:
        raise ConfigError(name, text, f"an integer >= {minimum}")
    return v


def _offloads(text: str | None, row, *, calibrate: bool) -> tuple[str, ...] | None:
    """``--offloads``: the settings to search (None: the default, decided once the host link is known)."""
    if text is None:
        return None
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in OFFLOAD_FLAG]
    if bad or not names:
        raise ConfigError("offloads", text, "comma-separated " + ", ".join(OFFLOAD_FLAG))
    chosen = tuple(dict.fromkeys(OFFLOAD_FLAG[x] for x in names))
    if any(chosen) and row.host_bytes_per_s is None and not calibrate:
        raise ConfigError("offloads", text, "none without a host link to price the copies",
                          f"device {row.name} has no host link in the table: with --device cpu pass --calibrate "
                          "(it measures the host copy), or --offloads none")
    return chosen


def _compile_speedup(text: str | None, row) -> float | str | None:
    """``--compile-speedup``: None (compile not searched), "measure" (cpu only) or a ratio > 0."""
    if text is None:
        return None
    allowed = "a positive ratio (eager step / compiled step, e.g. 1.3) or measure (with --device cpu)"
    if str(text).strip() == "measure":
        if row.peak_row is not None:
            raise ConfigError("compile-speedup", text, allowed, "measure times steps on this machine's CPU; for "
                              f"{row.name} pass the ratio measured there")
        return "measure"
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ConfigError("compile-speedup", text, allowed) from None
    if not 0.0 < v < math.inf:  # NaN fails too
        raise ConfigError("compile-speedup", text, allowed)
    return v


def _headroom(text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if not 0.0 <= v < 1.0:  # NaN fails both comparisons; inf and negatives fail one
        raise ConfigError("headroom", text, "a number in [0, 1), the share of device memory kept free")
    return v


def _rate(name: str, text: str | None) -> float | None:
    if text is None:
        return None
    value, allowed = str(text), "a bandwidth of at least 1 byte/s (and at most 16 EiB/s) such as 450GB/s or 50GB/s"
    try:
        return float(parse_bytes(name, value[:-2] if value.endswith("/s") else value, allowed=allowed))
    except ConfigError:
        raise ConfigError(name, value, allowed) from None  # the text as typed, "/s" included


class _ConfigKeys(Collection):
    """The keys ``trainfit train`` takes for a ``transformers`` config class (as ``tasks.hf`` reads them:
    its fields, their aliases, and properties such as ``num_labels``)."""

    def __init__(self, config_class) -> None:
        self.default = config_class()
        self.names = sorted(set(self.default.to_dict()) | set(getattr(config_class, "attribute_map", {})))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.names or hasattr(self.default, key))

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def hf_config_keys(spec: str) -> Collection[str] | None:
    """The config keys of ``hf:Class`` from ``transformers``, or None where it is not installed or has no such
    class (then the task builder says so). Imported only when a key needs it (seconds)."""
    try:
        if importlib.util.find_spec("transformers") is None:
            return None
    except (ImportError, ValueError):
        return None
    import transformers  # lazy: seconds to import, and only some plans (an hf: key beyond the shape's) need it

    try:
        config_class = getattr(getattr(transformers, spec.removeprefix("hf:"), None), "config_class", None)
        return _ConfigKeys(config_class) if isinstance(config_class, type) else None
    except Exception:  # a class transformers cannot import here, a config without defaults: the task builder's to say
        return None


def check_model(job_cfg) -> PlannedModel:
    """The model of the job in ``job_cfg`` to plan for, refused exactly where ``trainfit train`` would refuse it,
    before any search."""
    planned = plan_model(job_cfg.model, job_cfg.model_config, seq_len=job_cfg.seq_len, config_keys=hf_config_keys)
    if planned.check_task:  # train's own checks: token rules, transformers' validation, the user's callable
        check_task(make_config({"model": planned.model, "model_config": planned.model_config}, base=job_cfg))
    return planned


def checked_model(job_cfg) -> PlannedModel:
    """:func:`check_model` of the job in ``job_cfg``, remembered in the basis cache under the same key rules
    (the model, its config, the sequence, the data and every file they name, the versions of torch,
    transformers and trainfit's source): a job accepted once is not built again, which spares importing
    ``transformers`` (seconds) when every basis is cached too. A refusal is never remembered."""
    key = cache_key(job_cfg, target="checked-model")
    record = read_record("checked", key)
    if record is not None:
        try:
            shape = record["shape"]
            return PlannedModel(model=record["model"], model_config=record["model_config"],
                                shape=None if shape is None else TransformerShape(**shape),
                                notes=tuple(record["notes"]), check_task=record["check_task"])
        except (KeyError, TypeError):  # another layout: check again
            pass
    planned = check_model(job_cfg)
    write_record("checked", key, dataclasses.asdict(planned))
    return planned


def _read_data(spec: DataSpec) -> TextData:
    # lazy: reading data builds its datasets (torch); a plan of generated data, cached, never imports torch
    from trainfit.tasks.files import load_text_data

    return load_text_data(spec)


def data_model_config(model: str, model_config: str, text: TextData | None) -> str:
    """``model_config`` with the vocabulary ``trainfit train`` takes from the data's tokenizer: a GPT built-in
    whose ``vocab_size`` the user left open gets the tokenizer's (``tasks.builtin.gpt_task``)."""
    if text is None or run_spec(model, model_config)[0] not in GPT_PRESETS:
        return model_config
    if "vocab_size" in parse_model_config(model_config):
        return model_config
    return ",".join(x for x in (model_config.strip(), f"vocab_size={text.vocab_size}") if x)


def _extra_policy(spec: str) -> bool:
    """every:K, selective and budget:F: the policies plan can cost beyond its defaults (a malformed one is not)."""
    try:
        policy = parse_checkpoint_policy(spec)
    except ConfigError:
        return False
    return isinstance(policy, (EveryKthBlock, SelectiveOps, MemoryBudget))


def check_flags(args) -> dict:
    """Every flag parsed and range-checked, and every output path checked, before any work."""
    check_unique_keys("model_config", args.model_config)  # the user's text: a repeated key would silently win
    found = read_from(args.from_file) if getattr(args, "from_file", None) else None
    job, overridden = (plan_job(found, global_batch=args.global_batch, devices=args.devices, nodes=args.nodes)
                       if found is not None else ({}, {}))
    if found is None and args.global_batch is None:
        raise ConfigError("global-batch", None, "an integer >= 1", "pass --global-batch N (or --from FILE)")
    args.global_batch = job.get("global_batch", args.global_batch)
    args.devices, args.nodes = job.get("devices", args.devices or "1"), job.get("nodes", args.nodes or "1")
    if found is not None and args.optimizer == str(Optimizer.ADAMW):  # the default: the file's optimizer, if any
        args.optimizer = str(found.values.get("optimizer", args.optimizer))
    devices, nodes = _int("devices", args.devices), _int("nodes", args.nodes)
    if devices % nodes:
        raise ConfigError("nodes", args.nodes, f"a divisor of devices={devices}", "every node holds the same number")
    subsets, aliases = {}, []
    for flag, allowed in (("precisions", PRECISION_CHOICES), ("checkpointings", CHECKPOINT_CHOICES),
                          ("strategies", STRATEGY_CHOICES)):
        text = getattr(args, flag)
        if text is not None:
            chosen = tuple(x.strip() for x in text.split(",") if x.strip())
            if flag == "precisions":  # Lightning's and HF's spellings: trainfit's names, echoed once accepted
                aliases = [n for n in map(precision_alias_note, chosen) if n]
                chosen = tuple(canonical_precision(x) for x in chosen)
            bad = [x for x in chosen if x not in allowed and not (flag == "checkpointings" and _extra_policy(x))]
            if bad or not chosen:
                raise ConfigError(flag, text, allowed)
            subsets[flag] = chosen
    flags = dict(
        devices=devices, nodes=nodes, subsets=subsets, headroom=_headroom(args.headroom),
        global_batch=_int("global-batch", args.global_batch),
        memory_bytes=parse_bytes("device-memory", args.device_memory),
        seq=_int("seq", args.seq_len, 2), top=_int("top", args.top),
        explain=_int("explain", args.explain) if getattr(args, "explain", None) is not None else None,
        intra=_rate("bandwidth-intra", args.bandwidth_intra), inter=_rate("bandwidth-inter", args.bandwidth_inter),
        row=device_row(args.device),
        write_for=check_write_for(args.write_for, force=args.force) if getattr(args, "write_for", None) else None,
        write=check_output_file("write", args.write, force=args.force, suffix=".toml") if args.write else None,
        found=(found, overridden) if found is not None else None, aliases=aliases,
    )
    if flags["write_for"] is not None:  # only what the tool runs as planned on this device: searched, or refused
        runs = runnable_strategies(flags["write_for"][0], subsets.get("strategies"), cpu=args.device == "cpu",
                                   devices=devices)
        if runs is not None:
            subsets["strategies"] = runs
    flags["compile_speedup"] = _compile_speedup(getattr(args, "compile_speedup", None), flags["row"])
    flags["offloads"] = _offloads(getattr(args, "offloads", None), flags["row"], calibrate=args.calibrate)
    if args.basis not in BASIS_SOURCES:
        raise ConfigError("basis", args.basis, BASIS_SOURCES)
    if args.calibrate and flags["row"].peak_row is not None:
        raise ConfigError("calibrate", True, "--device cpu", "calibration measures steps on this machine's CPU")
    make_config({"optimizer": args.optimizer})  # refused here, not after the model is read
    if args.report:
        check_run_dir(args.run_dir)
    if flags["explain"] is not None and flags["explain"] > flags["top"]:
        raise ConfigError("explain", args.explain, f"a row number from 1 to --top ({flags['top']})")
    return flags


def make_plan(args, flags: dict | None = None):
    """Parse the flags, search, and return (result, base config, devices per node, basis used, space)."""
    flags = check_flags(args) if flags is None else flags
    devices, nodes, row, subsets = flags["devices"], flags["nodes"], flags["row"], flags["subsets"]
    speedup = flags.get("compile_speedup")
    host_bw = row.host_bytes_per_s
    if host_bw is None and args.calibrate:
        host_bw = measure_host_copy()  # cpu: offload's copies are memcpys (~0.1 s to measure)
    offloads = flags.get("offloads")
    if offloads is None:  # default: every setting where the copies can be priced
        offloads = OFFLOAD_CHOICES if host_bw else ("",)
    space = SearchSpace(global_batch=flags["global_batch"], devices=devices, memory_bytes=flags["memory_bytes"],
                        headroom=flags["headroom"], compiles=(False,) if speedup is None else (False, True),
                        offloads=offloads, **subsets)
    seq = flags["seq"]
    job = {"lora": args.lora, "freeze": args.freeze,
           **{k: getattr(args, k) for k in FILE_DATA_FLAGS if getattr(args, k, None) is not None}}
    spec = DataSpec.from_config(make_config({"seq_len": seq, **job}))  # None: the task's generated data
    text = _read_data(spec) if spec is not None else None  # read (and refused) as train reads it
    job_cfg = make_config({"model": args.model, "model_config": data_model_config(args.model, args.model_config, text),
                           "seq_len": seq, **job})
    planned = checked_model(job_cfg)
    if text is not None and planned.shape is not None:  # train's own refusals (check_task may skip the task)
        check_model_fits(text, vocab_size=planned.shape.vocab_size, max_positions=None, seq_len=seq,
                         model=planned.model)
    base = make_config({"model": planned.model, "model_config": planned.model_config, "seq_len": seq,
                        "optimizer": args.optimizer, **job})
    header: list[str] = []
    tuned = None  # what trains under --lora / --freeze (analytic shapes; the estimator reads the config itself)
    if planned.shape is not None and (base.lora or base.freeze):
        tuned = trainable(planned.shape, freeze=base.freeze, lora=parse_lora(base.lora))
        header.append(tuned.description)
    rows = seq  # tokens per row the activations are sized for: the longest row the data produces
    if text is not None:
        rows = min(text.longest, seq)
        header.append(f"activations sized for rows of {rows:,} tokens: the longest this data produces"
                      + (" (packing: full seq_len)" if base.packing else f" (packing off: its longest document, "
                                                                          f"at most --seq {seq})"))
    basis, used = basis_provider(base, source=args.basis, target=row.name)
    ctx = Context(devices=devices, dtypes=dtypes_of(row))
    if used == "fast" and "checkpointings" not in subsets:
        # every:K traces twice the blocks of the others (K x 3 and K x 4 blocks, the unit being K blocks) and
        # would take half the cold time; the traced default keeps none and full, and says so
        space = dataclasses.replace(space, checkpointings=FAST_DEFAULT_CHECKPOINTINGS)
        header.append(f"checkpointing searched: {', '.join(FAST_DEFAULT_CHECKPOINTINGS)} (every:2 traces twice the "
                      "blocks, so a traced basis leaves it out unless asked: --checkpointings none,every:2,full)")
    # A traced default plan on a GPU row searches without full checkpointing and fp32 first, and traces them
    # only where one of their rows could rank first (checked after the search: _Deferred).
    # (the bound reads datasheet rates: not where a CPU row's rate or a compile speed-up is measured per pair)
    deferred = [d for d in (_FULL, _FP32) if used == "fast" and d.flag not in subsets and not flags["found"]
                and speedup != "measure" and d.value in getattr(space, d.flag) and d.applies(row)]
    full_space = space
    for d in deferred:
        space = d.narrow(space)
    bases: dict = {}
    t0 = time.perf_counter()
    if used == "fast":  # every pair the search will ask for, traced in parallel (or read from the cache)
        bases.update(prefetch(base, needed_pairs(space, ctx), target=row.name,
                              progress=lambda msg: print("plan: " + msg, file=sys.stderr, flush=True)))
        basis = lambda p, ck: bases[(p, ck)]  # noqa: E731 -- the search asks for these pairs only
        header.append("")  # the basis line, written once the deferred pairs are settled (below)
    basis_line = len(header) - 1
    if used == "analytic" and (tuned is not None or rows != seq):
        shape = planned.shape
        basis = (lambda p, ck: analytic_basis(shape, precision=p, checkpointing=ck, seq_len=rows,
                                              optimizer=base.optimizer, trainable=tuned))
    elif (base.lora or base.freeze) and planned.shape is None:
        header.append(f"--lora/--freeze: the {used} basis builds the model with them and counts what trains")
    header.extend(_source_lines(basis, used, row, base, calibrate=args.calibrate, needed=needed_pairs(space, ctx),
                                clocked=clock_facts(row) is not None and planned.shape is not None))
    latency_s = 0.0
    intra = flags["intra"]
    if row.peak_row is None and args.calibrate and devices > 1:
        # Per-collective-call latency on CPU: gloo's path between ranks on one host is TCP loopback;
        # its one-way latency is one ring step (as measure/scaleout.py uses it without a live group).
        loop_bw, latency_s = measure_loopback()
        intra = intra or loop_bw
    links = links_provider(row, nodes=nodes, devices=devices, intra=intra, inter=flags["inter"], latency_s=latency_s,
                           host_bytes_per_s=host_bw)
    facts = clock_facts(row)
    if facts is not None and planned.shape is not None:  # a GPU row and the model's shape: priced op by op
        links = clocked_links(links, DeviceClock(**facts), planned.shape, seq_len=rows)
        header.extend(_clock_lines(facts, tuned is not None))
    header.append(_offload_source(offloads, host_bw, row))
    dist_rows = ()
    with contextlib.ExitStack() as scope:
        if args.calibrate:
            if row.peak_row is not None:
                raise ConfigError("calibrate", True, "--device cpu", "calibration measures steps on this machine's CPU")
            if devices > 1:
                # Ranks sharing this CPU run one torch thread each (torchrun sets OMP_NUM_THREADS=1 for
                # several processes per host): fit the compute at that. calibrated_links measures
                # lazily, during the search, so the setting holds until the search is done.
                scope.enter_context(_torch_threads(1))
            links = _calibrate().calibrated_links(base, links, basis)
            if devices > 1:
                # gloo ranks on one CPU pay more than link time: FSDP2's per-unit work, each collective's
                # wait for its peer. Measured on 2 processes here and fitted per (strategy, grad_sync).
                print("plan: measuring the distributed overhead on 2 gloo processes (about a minute) ...",
                      file=sys.stderr, flush=True)
                links, dist_rows = _calibrate().with_dist_overhead(links, base, basis, world=2,
                                                                   strategies=subsets.get("strategies"))
        if speedup is not None:
            links, compile_note = _with_compile_speedup(links, base, speedup)
            header.append(compile_note)
        result = search(space, ctx=ctx, basis=basis, links=links)
        for d in deferred:  # full checkpointing first (what often makes a large model fit), then fp32
            uncheckpointed = [b for (p, ck), b in bases.items() if ck == "none"]
            floor, fastest = step_floor(d.only(space), uncheckpointed, ctx=ctx, links=links)
            best = result.best
            if fastest is None:  # every one of its candidates breaks a rule: the search would drop them all
                header.append(f"{d.flag}: {d.value} not traced: none of its candidates is compatible here")
                continue
            if best is not None and floor > best.step_s:
                header.append(f"{d.flag}: {d.value} not traced: no {d.value} row can step faster than {floor:.4g} s "
                              f"here ({_floor_how(fastest, uncheckpointed[0])}), slower than the best plan's "
                              f"{best.step_s:.4g} s, so none can rank first (--{d.flag} "
                              f"{','.join(getattr(full_space, d.flag))} to price it anyway)")
                continue
            header.append(f"{d.flag}: {d.value} traced too, after the others: " + (
                "nothing fits without it" if best is None else
                f"its rows could step in {floor:.4g} s ({_floor_how(fastest, uncheckpointed[0])}), not slower "
                f"than the best plan without it ({best.step_s:.4g} s)"))
            space = d.widen(space, full_space)
            bases.update(prefetch(base, needed_pairs(space, ctx), target=row.name))
            result = search(space, ctx=ctx, basis=basis, links=links)
    if used == "fast":
        own = {(p, ck): b for (p, ck), b in bases.items() if p not in TRACED_AS}  # fp16 pairs reuse the bf16 trace
        traced = sum("cached" not in b.source for b in own.values())
        header[basis_line] = (f"basis: fast fake-tensor traces of {base.model} ({traced} of {len(own)} traces made "
                              f"now, the rest read from the cache {cache_dir()}; {len(bases) - len(own)} fp16 pairs "
                              f"from their bf16 trace; {time.perf_counter() - t0:.1f} s)")
    result.notes[:0] = header  # first: the job these plans are for
    result.notes.extend(planned.notes)
    if result.entries and space.offloads == ("",):  # not searched: what it would free and cost, in words
        result.notes.extend(_offload_notes(result, basis, row, space, base))
    if dist_rows:
        fitted = ", ".join(f"{s}/{sync} {ps * 1e3:+.1f} ms/step {pm * 1e3:+.1f} ms/micro-batch"
                           for s, sync, ps, pm in dist_rows)
        result.notes.append(f"distributed overhead measured on 2 gloo processes of this machine and applied to "
                            f"{devices} devices: {fitted}")
    if row.peak_row is None and not args.calibrate:
        result.notes.append("cpu step times assume the calibrated matmul rate, which a small model does not reach; "
                            "pass --calibrate to fit them to this model's measured steps")
    return result, base, devices // nodes, used, space, len(header)


def _calibrate():
    """``trainfit.probes.calibrate``, imported on first use."""
    # lazy: calibration and the measured compile speed-up build, compile and step runs here; a plan that
    # measures nothing never imports the run
    import trainfit.probes.calibrate as calibrate

    return calibrate


def _with_compile_speedup(links, base, speedup):
    """``links`` carrying the compile speed-up (given, or measured per pair on this CPU) and its source line."""
    if speedup != "measure":
        return ((lambda p, ck="none": dataclasses.replace(links(p, ck), compile_speedup=speedup)),
                f"compile: compute priced at {speedup:g}x the eager speed (--compile-speedup, as given); memory "
                "as eager")
    print("plan: measuring eager vs compiled steps of this model (a compile per pair; minutes when inductor's "
          "cache is cold) ...", file=sys.stderr, flush=True)
    return (_calibrate().compile_speedup_links(base, links),
            "compile: compute priced at the eager/compiled step ratio measured on this CPU per (precision, "
            "checkpointing), interleaved steps at the basis micro-batch (probes.compile.measure_compile_speedup); "
            "memory as eager")


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch  # a calibrating plan's: the others never import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan_config(entry, base, *, devices: int, global_batch: int):
    """The RunConfig that runs ``entry`` (``trainfit train PLAN.toml``)."""
    values = {"precision": entry.precision, "micro_batch": entry.micro_batch, "accumulation": entry.accumulation,
              "checkpointing": entry.checkpointing, "strategy": entry.strategy, "grad_sync": entry.grad_sync,
              "devices": devices}
    if strategy_facts(entry.strategy).distributed:
        values["global_batch"] = global_batch
    if entry.compile:
        values["compile"] = True
    if entry.offload:
        values["offload"] = entry.offload
    return make_config(values, base=base)


def run(args) -> int:
    flags = check_flags(args)  # every flag and output path refused before any work
    for line in flags["aliases"]:
        print(line, file=sys.stderr)
    for line in (flags["found"][0].lines(flags["found"][1]) if flags["found"] else ()):
        print(line, file=sys.stderr)  # --from: what was read from the other tool's file, what ignored
    result, base, per_node, used, space, n_header = make_plan(args, flags)
    if flags["found"]:
        result.notes.append(rank_note(flags["found"][0], result.entries))
    shown = result.entries[:flags["top"]]
    if result.best is None:  # the candidates and why each fails (stderr), then a refusal: exit 2, nothing written
        _print_plan(result, shown, n_header, file=sys.stderr)
        wanted = [f for f, v in (("--write", flags["write"]), ("--write-for", flags["write_for"]),
                                 ("--report", args.report or None)) if v is not None]
        raise TrainfitError("plan: nothing fits, so there is no plan to run"
                            + (f" and nothing was written ({', '.join(wanted)})" if wanted else "") + ": "
                            + "; ".join(n for n in result.notes if n.startswith("nothing fits")))
    write, toml_text = flags["write"], None
    if write is not None:
        toml_text = dump_toml(plan_config(result.best, base, devices=per_node, global_batch=space.global_batch))
    exported = None
    if flags["write_for"] is not None:  # the same row, in the tool's own configuration
        exported = export_plan(flags["write_for"][0], plan_config(result.best, base, devices=per_node,
                                                                 global_batch=space.global_batch),
                               nodes=flags["nodes"], cpu=args.device == "cpu")
    out = None
    explained = _explain(result, shown, flags.get("explain"), space=space, base=base, row=flags["row"])
    if args.json or args.report:
        out = plan_report(result, shown, model=args.model, space=space, basis=used).to_dict()
        if explained is not None:
            out["explain"] = explained
        if flags["found"]:
            out["from"] = flags["found"][0].to_dict(flags["found"][1])
        text = dumps_json(out)  # strict JSON: made before anything is written, so a refusal leaves nothing
    # Everything that could refuse has run: only now is anything written.
    if toml_text is not None:
        write.write_text(toml_text)
    if exported is not None:
        flags["write_for"][1].write_text(exported.text)
        print(f"wrote {flags['write_for'][1]} for {exported.tool}; what it cannot express exactly:", file=sys.stderr)
        for gap in exported.gaps:
            print("  " + gap.line(), file=sys.stderr)
    if args.report:
        save_and_report(args.run_dir, "plan.json", out, report=True)  # claims the run dir checked above
    if args.json:
        print(text)
        return 0
    _print_plan(result, shown, n_header)
    if explained is not None:
        print(format_explain(explained))
    if write is not None:
        print(f"wrote {write}: run it with `trainfit train {write}`", file=sys.stderr)
    return 0


def _fp32_slow(row) -> bool:
    """A GPU row whose half precision runs at least twice fp32's dense peak: there a traced default plan searches
    the half precisions first and traces fp32 only if ``plan.search.step_floor`` says an fp32 row could rank first."""
    peak = find_device(row.peak_row) if row.peak_row else None
    if peak is None or Dtype.FP32 not in peak.peak_tflops:
        return False
    return max(peak.peak_tflops.get(d, 0.0) for d in (Dtype.BF16, Dtype.FP16)) >= 2 * peak.peak_tflops[Dtype.FP32]


def _floor_how(c, b) -> str:
    """Where a deferred choice's step floor (``plan.search.step_floor``) comes from, in words."""
    recompute = (f" plus the {b.full_recompute_flops_per_sample:.3g} per sample full checkpointing recomputes"
                 if c.checkpointing == "full" else "")
    return (f"its fastest candidate, {c.precision} {c.strategy} micro-batch {c.micro_batch} x {c.accumulation}, "
            f"priced at the model's FLOPs{recompute} and the communication of the traces without it; memory "
            "and offload aside")


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A choice a traced default plan prices only where one of its rows could rank first: searched without it,
    then traced when its fastest possible step is not slower than the best plan found, or when nothing fits."""

    flag: str
    """The flag and the SearchSpace field that list it (``--precisions``, ``--checkpointings``)."""
    value: str
    applies: Callable
    """``applies(device row)``: whether it is deferred on that device."""

    def only(self, space):
        return dataclasses.replace(space, **{self.flag: (self.value,)})

    def narrow(self, space):
        return dataclasses.replace(space, **{self.flag: tuple(v for v in getattr(space, self.flag) if v != self.value)})

    def widen(self, space, full):
        """``space`` with the value back, in ``full``'s order (a tie ranks as the whole search ranks it)."""
        kept = {*getattr(space, self.flag), self.value}
        return dataclasses.replace(space, **{self.flag: tuple(v for v in getattr(full, self.flag) if v in kept)})


_FULL = _Deferred(flag="checkpointings", value="full", applies=lambda row: row.peak_row is not None)
_FP32 = _Deferred(flag="precisions", value=PrecisionName.FP32, applies=_fp32_slow)


def _offload_source(offloads: tuple[str, ...], host_bw: float | None, row) -> str:
    """The plan's source line for offload: what was searched, and the host link it is priced at."""
    searched = [x for x in offloads if x]
    if not searched:
        why = ("--offloads none" if host_bw else f"device {row.name} has no host link to price its copies"
               + (" (pass --calibrate to measure this machine's)" if row.peak_row is None else ""))
        return f"offload: not searched ({why})"
    link = (f"{host_bw / 1e9:.3g} GB/s per direction, "
            + ("the device row's datasheet host link" if row.host_bytes_per_s else "a host copy measured on this CPU"))
    return (f"offload: searched {', '.join(x.replace(',', '+') for x in searched)} (zero3 moves params with the "
            f"optimizer; zero1 offloads activations only), priced at {link}; copies not overlapped (an upper bound)")


def _offload_notes(result, basis, row, space, base) -> list[str]:
    """What offload would free and cost for the best plan (or, when nothing fits, the smallest), when the search
    did not try it (``--offloads none``, or no host link): priced by the device row's host link, if any."""
    e = result.best or min(result.entries, key=lambda x: x.peak_bytes_per_device)
    if e.strategy == "zero1":
        return []
    b = basis(e.precision, e.checkpointing)
    w, _, master, _ = precision_facts(e.precision).bytes_per_param
    parts = ({OffloadPart.OPTIMIZER, OffloadPart.PARAMS} if e.strategy == "zero3" else {OffloadPart.OPTIMIZER})
    notes = []
    for chosen in (parts, {OffloadPart.ACTIVATIONS}):
        price = offload_price(parts=chosen, strategy=e.strategy, n_params=b.n_trainable or b.n_params,
                              world_size=space.devices, accumulation=e.accumulation, weight_bytes=w,
                              state_bytes_per_param=OPTIMIZER_BYTES[Optimizer(base.optimizer)],
                              master_bytes_per_param=master,
                              activation_bytes_per_micro_batch=int(e.parts.get("activations", 0)),
                              grad_sync=e.grad_sync, host_bytes_per_s=row.host_bytes_per_s)
        if not price.traffic:
            continue
        line = f"other lever for plan {'1' if result.best else '(smallest)'}: {price.reason}"
        if price.seconds_per_step is not None and e.step_s:
            line += f" (+{price.seconds_per_step / e.step_s:.0%} of its {e.step_s:.3g} s step if not overlapped)"
        if result.best is None:
            fits = e.peak_bytes_per_device - price.frees_device_bytes <= space.budget_bytes
            line += "; it would fit" if fits else "; still too big"
        notes.append(line + f" (--offload {','.join(sorted(str(p) for p in chosen))})")
    return notes


def _source_lines(basis, used: str, row, base, *, calibrate: bool, needed, clocked: bool = False) -> list[str]:
    """One line per source of the plan's numbers: the basis, the kernels it assumes, the device, the step times."""
    first = basis(*needed[0]) if needed else None
    lines = []
    if first is not None and used != "fast":
        lines.append(f"basis ({used}): {first.source}")
    elif first is not None:
        how, _, kernels = first.source.partition("; kernels of ")
        lines.append(f"basis trace: {how.removeprefix('fast trace (')}")
        lines.append(f"kernels of {kernels}" if kernels else "kernels: this machine's (cpu)")
    if used == "analytic":
        lines.append("kernels: none traced: the analytic shape counts the tensors its blocks save (flash-style "
                     "attention: no sequence-squared probabilities)")
    elif used != "fast":
        lines.append("kernels: this machine's CPU kernels (the estimate and measure bases trace or run here)")
    peak = find_device(row.peak_row) if row.peak_row else None
    lines.append(f"device {row.name} (meters.devices, every source there): " + row.source.split(";")[0]
                 + (f"; peak FLOP/s: {peak.source.split(';')[0]}" if peak else ""))
    if not clocked:
        lines.append("step times: " + ("fitted to steps measured on this machine (--calibrate)" if calibrate else
                                       f"FLOPs / ({row.achievable_frac:.0%} of the dense peak) plus the ring model of "
                                       "the links (plan.cost, plan.comm)"))
    return lines


def _clock_lines(facts: dict, tuned: bool) -> list[str]:
    """The op-level clock's source lines: how a step is priced and every coefficient's source."""
    lines = [f"step times: op by op (plan.clock) on {facts['name']}: GEMMs at max(FLOPs / {facts['gemm_share']:.0%} of "
             f"the dense peak, bytes / HBM), attention at {facts['attention_share']:.0%} of the peak (causal flash), "
             f"memory-bound ops at {facts['hbm_share']:.0%} of {facts['hbm_bytes_per_s'] / 1e12:.3g} TB/s, "
             f"{facts['kernel_s'] * 1e6:.3g} us per kernel, all / {facts['eager_share']:.2f} (eager share); "
             f"collectives at {facts['bus_share']:.0%} of the link, FSDP prefetch and DDP buckets overlapped"
             + ("; --lora/--freeze: backward priced whole (an upper bound)" if tuned else "")]
    lines.extend(f"clock source: {s}" for s in facts["sources"])
    return lines


def _print_plan(result, shown, n_header: int, file=None) -> None:
    for n in result.notes[:n_header]:  # the job, and where its numbers come from
        print(n, file=file)
    print(format_table(shown), file=file)
    for n in result.notes[n_header:]:
        print(n, file=file)


def plan_report(result, shown, *, model: str, space, basis: str) -> PlanReport:
    """The typed ``--json`` object: the job, the search's counts and notes, and the entries ``shown``."""
    return PlanReport(model=model, global_batch=space.global_batch, devices=space.devices,
                      device_memory_bytes=space.memory_bytes, basis=basis, candidates=result.candidates,
                      excluded=result.excluded, notes=tuple(result.notes),
                      plans=tuple(PlanRow.from_dict(e.to_dict()) for e in shown))


def format_table(entries) -> str:
    mw = max([5, *(len(str(e.micro_batch)) + 1 for e in entries)])  # a 10**18 batch keeps its columns apart
    aw = max([6, *(len(str(e.accumulation)) + 1 for e in entries)])
    cw = max([8, *(len(e.checkpointing) + 1 + len(" +compile") * e.compile for e in entries)])
    head = f"{'#':>3} {'precision':<11}{'mb':>{mw}}{'acc':>{aw}} {'ckpt':<{cw}}{'strategy':<9}{'sync':<16}" \
           f"{'peak/dev':>11}{'step s':>10}{'eff':>6}  fits / reasons"
    lines = [head]
    for i, e in enumerate(entries, 1):
        n = e.peak_bytes_per_device
        peak = fmt_bytes(n)
        why = "yes" if e.fits else "no"
        if e.reasons:
            why += ": " + "; ".join(e.reasons)
        ck = e.checkpointing + (" +compile" if e.compile else "")
        lines.append(f"{i:>3} {e.precision:<11}{e.micro_batch:>{mw}}{e.accumulation:>{aw}} {ck:<{cw}}"
                     f"{e.strategy:<9}{e.grad_sync:<16}{peak:>11}{e.step_s:>10.4g}{e.scaling_efficiency:>6.0%}  {why}")
    return "\n".join(lines)


EXPLAIN_PARTS = {"compute_bound_s": "compute-bound (GEMMs, attention)",
                 "memory_bound_s": "memory-bound (norms, activations, casts, loss, optimizer step)",
                 "recompute_s": "recompute (checkpointing)", "exposed_comm_s": "exposed communication",
                 "fixed_s": "fixed cost (kernel launches, per-step overheads)",
                 "dist_overhead_s": "measured distributed overhead", "offload_s": "offload copies"}
"""``plan --explain``'s parts of a step (``plan.cost.Time.parts``), in the order printed."""


def _explain(result, shown, n: int | None, **_) -> dict | None:
    """Row ``n`` of the table (1-based) split into the parts of its step, or None when not asked."""
    if n is None:
        return None
    if n > len(shown):
        raise ConfigError("explain", n, f"a row number from 1 to {len(shown)} (the rows shown)")
    e = shown[n - 1]
    return {"row": n, "precision": e.precision, "micro_batch": e.micro_batch, "accumulation": e.accumulation,
            "checkpointing": e.checkpointing, "strategy": e.strategy, "grad_sync": e.grad_sync, "step_s": e.step_s,
            "parts": dict(e.time_parts)}


def format_explain(x: dict) -> str:
    """The ``--explain`` block: each part in seconds and as a share of the step."""
    head = (f"explain row {x['row']}: {x['precision']}, micro-batch {x['micro_batch']} x {x['accumulation']}, "
            f"checkpointing {x['checkpointing']}, {x['strategy']} ({x['grad_sync']}): {x['step_s']:.4g} s/step")
    step = x["step_s"] or 1.0
    lines = [head] + [f"  {label:<62}{x['parts'].get(k, 0.0):>11.4g} s {x['parts'].get(k, 0.0) / step:>6.1%}"
                      for k, label in EXPLAIN_PARTS.items() if k in x["parts"]]
    return "\n".join(lines)
