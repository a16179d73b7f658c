"""Which class runs each architecture (models/__init__.py: MODEL_CLASSES) and which path its
decoder layers take on the CPU: the compiled DecoderStack (csrc/cpu_decoder.cpp), which computes
Llama's layer, for the families whose layer is Llama's; the Python layers for every other.

Each family's tiny random checkpoint (tests/models/test_families.py, made with transformers)
runs in an engine on the CPU with the compiled kernels: a family that takes the stack runs its
decode steps through it, token-identical to the same engine with its Python layers; any other
has no stack at all. (Whether those tokens are right is test_families.py's business.)
"""

from __future__ import annotations

import pytest

from tests.models.test_cpu_decoder import CountingStack, cpu_llm, kernels
from tests.models.test_families import FAMILIES, make_checkpoint
from tokenmill import SamplingParams
from tokenmill.models import MODEL_CLASSES
from tokenmill.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM, MistralForCausalLM
from tokenmill.models.loader import supported_architectures
from tokenmill.models.mixtral import MixtralForCausalLM
from tokenmill.models.phi3 import Phi3ForCausalLM
from tokenmill.models.qwen2 import Qwen2ForCausalLM, Qwen3ForCausalLM
from tokenmill.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

# test_families.py's family -> (its architecture, the class that runs it, whether the DecoderStack runs its layers)
PATHS = {
    "llama3.1-rope": ("llama", LlamaForCausalLM, True),
    "mistral": ("mistral", MistralForCausalLM, True),
    "qwen2-yarn": ("qwen2", Qwen2ForCausalLM, True),
    "phi3": ("phi3", Phi3ForCausalLM, True),
    "qwen3": ("qwen3", Qwen3ForCausalLM, False),  # q/k norms
    "gemma2": ("gemma2", Gemma2ForCausalLM, False),  # sandwich norms, GeGLU, soft-caps
    "gemma3": ("gemma3", Gemma3ForCausalLM, False),  # and q/k norms, a second RoPE base
    "mixtral": ("mixtral", MixtralForCausalLM, False),  # experts
    "qwen2-moe": ("qwen2_moe", Qwen2MoeForCausalLM, False),
    "qwen3-moe": ("qwen3_moe", Qwen3MoeForCausalLM, False),
}


def test_every_architecture_has_one_class_and_is_tested_here():
    assert MODEL_CLASSES.keys() == set(supported_architectures())
    assert PATHS.keys() == FAMILIES.keys()
    assert {arch for arch, _, _ in PATHS.values()} == set(supported_architectures())
    for arch, cls, stack in PATHS.values():
        assert MODEL_CLASSES[arch] is cls and cls.takes_cpu_decoder is stack, arch


@pytest.mark.skipif(kernels is None, reason="CPU kernels not built here")
@pytest.mark.parametrize("family", PATHS)
def test_decoder_path(family, test_tokenizer, tmp_path, monkeypatch):
    arch, cls, takes_stack = PATHS[family]
    make_checkpoint(tmp_path, FAMILIES[family](), test_tokenizer)
    llm = cpu_llm(str(tmp_path), dtype="float32", quantization="none")
    model = llm.engine.core.runner.model
    assert model.config.architecture == arch and type(model) is cls
    if not takes_stack:
        assert model.cpu_decoder is None  # so every step runs the Python layers
        return
    assert model.cpu_decoder is not None
    # 3 prompt tokens and 5 new ones stay within the windows (8) of Mistral and Phi-3: every decode is the stack's
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    spy = CountingStack(model.cpu_decoder)
    monkeypatch.setattr(model, "cpu_decoder", spy)
    through_stack = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert spy.rows.count(1) == 4  # each decode step (after the prefill's first token)
    monkeypatch.setattr(model, "cpu_decoder", None)
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == through_stack
