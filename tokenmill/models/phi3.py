"""Phi-3: Llama's layer, whose checkpoints hold q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`, fused as the linears here are, so nothing is packed on load (each loads whole:
`CausalLM.whole_shard`). Every layer may slide a window. The compiled CPU decoder takes it.
"""

from __future__ import annotations

from tokenmill.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    takes_cpu_decoder = True
    packed_modules = {}  # the checkpoint's projections are already fused
