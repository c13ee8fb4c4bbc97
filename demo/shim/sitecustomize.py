"""Test/demo-only start-up shim for SGLang engine subprocesses on CPU.

Put this folder on PYTHONPATH of engine subprocesses only (demo/engines.py
does); never on an engine image. Python imports ``sitecustomize`` at start-up.

1. torchvision op schemas. PyPI's torchvision wheels are CUDA builds. With the CPU
   torch build its C extension registers no ``torchvision::nms``, and ``import
   torchvision`` (SGLang imports it from ``srt/multimodal/internvl_utils.py``) fails in
   its fake-op registration. Declaring the two schemas first lets the import succeed;
   nothing here ever calls them.
2. ``KVGUARD_CPU_ARCH_SHIMS`` (set by demo/engines.py for the tiny MLA / DSA models
   only): the CPU kernel shims of demo/arch_shims.py, installed as post-import hooks
   before SGLang is imported.
"""

import os
import sys

try:
    import torch

    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # noqa: BLE001 - a shim must never break interpreter start-up
    pass

if os.environ.get("KVGUARD_CPU_ARCH_SHIMS", "").strip():
    try:
        from kvguard.demo import arch_shims

        arch_shims.install_from_env()
    except Exception as exc:  # noqa: BLE001 - say why in the engine log; the engine then fails visibly
        sys.stderr.write(f"[kvguard arch_shims] not installed: {type(exc).__name__}: {exc}\n")
