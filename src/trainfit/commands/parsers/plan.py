"""``trainfit plan``'s flags (the command: :mod:`trainfit.commands.plan`).

Its choices are read from their homes: the search's subsets and ``--offloads`` names from the plan request
(``trainfit.front.plan_request``, pure Python: it imports neither torch nor numpy), the devices from
``trainfit.meters.devices``, the tools from ``trainfit.integrations.export_plan``.
"""

from __future__ import annotations

from trainfit.config import SECTION_OF, SECTIONS
from trainfit.front.plan_request import CHECKPOINT_CHOICES, FILE_DATA_FLAGS, OFFLOAD_FLAG, subsets
from trainfit.integrations.export_plan import TOOLS
from trainfit.meters.devices import DEVICES
from trainfit.presets import MODEL_HELP
from trainfit.vocabulary import Optimizer, choices

GROUPS = (*SECTIONS, "output")
"""``plan --help``'s groups: the config's sections (``trainfit.config.SECTIONS``), then what is printed and
written."""

PLAN_ONLY = {
    "from_file": "run", "device_memory": "distribution", "nodes": "distribution", "device": "distribution",
    "bandwidth_intra": "distribution", "bandwidth_inter": "distribution", "headroom": "distribution",
    "strategies": "distribution", "precisions": "levers", "checkpointings": "levers", "offloads": "levers",
    "compile_speedup": "levers", "basis": "run", "calibrate": "run", "top": "output", "explain": "output",
    "json": "output", "report": "output", "write": "output", "write_for": "output", "force": "output",
}
"""The group of each flag that is not a RunConfig field (those go to their section, ``config.SECTION_OF``)."""

DESCRIPTIONS = {"levers": "the choices searched (default: all of each)",
                "distribution": "the devices: --devices per node x --nodes in all",
                "run": "where the job and the numbers come from", "output": "what is printed and written"}


def register(sub) -> None:
    p = sub.add_parser("plan", help="choose the levers for a job so it fits and runs fastest", add_help=False)
    groups = {name: p.add_argument_group(name, DESCRIPTIONS.get(name)) for name in GROUPS}

    def add(*flags, dest: str, **kw) -> None:
        groups[PLAN_ONLY.get(dest) or SECTION_OF[dest]].add_argument(*flags, dest=dest, **kw)

    add("--model", dest="model", default="gpt-tiny", help=MODEL_HELP)
    add("--model-config", dest="model_config", default="", help="key=value,... overrides")
    add("--lora", dest="lora", default="", help="plan for LoRA adapters as train takes them: r=8,alpha=16,"
                                                "targets=q_proj,v_proj (only the adapters train)")
    add("--freeze", dest="freeze", default="", help="comma-separated glob patterns of parameter names frozen, as "
                                                    "train takes them (no gradients, no optimizer state)")
    add("--seq", "--seq-len", dest="seq_len", default="64", help="sequence length in tokens")
    for key, help_text in FILE_DATA_FLAGS.items():
        add("--" + key.replace("_", "-"), dest=key, help=help_text)
    add("--global-batch", dest="global_batch", help="samples per optimizer step over all devices (required "
                                                    "unless --from sets a per-device batch)")
    add("--devices", dest="devices", help="devices per node, as torchrun's --nproc_per_node and Lightning's "
                                          "devices (default 1); the plan is for devices x nodes in all")
    add("--nodes", dest="nodes", help="nodes, each with --devices devices (default 1)")
    add("--device-memory", dest="device_memory", required=True, help="memory per device, e.g. 80GiB")
    add("--device", dest="device", default="h100", help=f"the device to plan for: {choices(DEVICES)} (default h100)")
    add("--bandwidth-intra", dest="bandwidth_intra", help="per-device bandwidth inside a node, e.g. 450GB/s")
    add("--bandwidth-inter", dest="bandwidth_inter", help="per-device bandwidth between nodes, e.g. 50GB/s")
    add("--headroom", dest="headroom", default="0.1", help="share of device memory kept free (default 0.1)")
    add("--strategies", dest="strategies", help=f"comma-separated subset of {', '.join(subsets()['strategies'])}")
    add("--precisions", dest="precisions", help=f"comma-separated subset of {', '.join(subsets()['precisions'])}")
    add("--checkpointings", dest="checkpointings",
        help=f"comma-separated subset of {', '.join(CHECKPOINT_CHOICES)}, or every:K, selective, budget:F "
             "(default: none, every:2, full; none, full for a traced basis)")
    add("--offloads", dest="offloads", help="comma-separated subset of " + ", ".join(OFFLOAD_FLAG)
        + ": what the search may keep in host memory, each priced at the host link (default: all of them where "
          "the device row has a host link or --calibrate measures one on cpu; none otherwise)")
    add("--compile-speedup", dest="compile_speedup", metavar="F|measure",
        help="add torch.compile (per block) to the search, its compute priced at F times the eager step's speed "
             "(a ratio you measured, e.g. with `trainfit profile --compile on` on the device), or `measure` (cpu): "
             "eager and compiled steps of this model, interleaved (a compile per (precision, checkpointing) pair: "
             "minutes when inductor's cache is cold)")
    add("--optimizer", dest="optimizer", help=f"{choices(Optimizer)} (default adamw, or the --from file's)")
    add("--from", dest="from_file", metavar="FILE",
        help="the job of a transformers TrainingArguments JSON, an accelerate config YAML or Lightning Trainer "
             "arguments: global batch, devices, nodes (flags override it); says where its own configuration ranks")
    add("--basis", dest="basis", default="auto", help="auto, analytic, estimate or measure: where the parts come from")
    add("--calibrate", dest="calibrate", action="store_true",
        help="cpu: fit the compute rate to a few measured steps of this model (under 2 min); with more than one "
             "device also the distributed overhead, measured on 2 gloo processes (~1 min). A GPU row on a machine "
             "with CUDA: measure this device's GEMM rates, memory and host-link bandwidth and plan with them")
    add("--run-dir", dest="run_dir", default="runs/default", help="where --report writes (default runs/default)")
    _add_output_flags(add)
    groups["output"].add_argument("-h", "--help", action="help", help="show this help and exit")


def _add_output_flags(add) -> None:
    add("--top", dest="top", default="10", help="entries to show")
    add("--explain", dest="explain", metavar="N",
        help="break row N's step into compute-bound, memory-bound, recompute, exposed communication and fixed cost "
             "(and in --json)")
    add("--json", dest="json", action="store_true", help="print one JSON object on stdout")
    add("--report", dest="report", action="store_true",
        help="also save RUN_DIR/plan.json and write RUN_DIR/report.html")
    add("--write", dest="write", metavar="PLAN.toml", help="write the best plan as a config `trainfit train` runs")
    add("--write-for", dest="write_for", nargs=2, metavar=("TOOL", "FILE"),
        help=f"write the best plan as {choices(TOOLS)}'s own configuration (TrainingArguments JSON, accelerate "
             "config YAML, Lightning Trainer/Fabric JSON); prints what the tool cannot express")
    add("--force", dest="force", action="store_true", help="let --write / --write-for replace an existing file")
