"""Test/demo-only start-up shim for SGLang engine subprocesses on CPU.

Put this folder on PYTHONPATH of engine subprocesses only (demo/engines.py
does); never on an engine image. Python imports ``sitecustomize`` at start-up.

Why: PyPI's torchvision wheels are CUDA builds. With the CPU torch build its C
extension registers no ``torchvision::nms``, and ``import torchvision`` (SGLang
imports it from ``srt/multimodal/internvl_utils.py``) fails in its fake-op
registration. Declaring the two schemas first lets the import succeed; nothing
here ever calls them.
"""

try:
    import torch

    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # noqa: BLE001 - a shim must never break interpreter start-up
    pass
