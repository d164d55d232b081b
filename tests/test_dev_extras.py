"""The test command runs every proof: the dev extra's dependencies are importable.

Tests that need one of them import it with pytest.importorskip, so a missing package would
otherwise show only as skips; this test fails instead and names what to install.
"""

import importlib.util

import pytest

# module -> the proofs that need it
PROOF_DEPENDENCIES = {
    "torch": "the PyTorch reference model, Hugging Face GPT-2 and Llama against torch autograd",
    "transformers": "Hugging Face GPT-2 and Llama in and out",
    "safetensors": "Hugging Face checkpoints",
    "pyarrow": "Parquet corpora for prepare",
    "nbclient": "the executed notebooks",
}


@pytest.mark.parametrize("module", sorted(PROOF_DEPENDENCIES))
def test_every_proof_dependency_is_installed(module):
    assert importlib.util.find_spec(module) is not None, (
        f"{module} is not installed, so these tests skip: {PROOF_DEPENDENCIES[module]}. "
        f"Install the dev extra: pip install -e '.[dev]'")
