"""`import kvwarden.vllm` without the vllm extra names the install, not a bare module."""

import subprocess
import sys

import pytest

# A child interpreter in which `torch` (then `vllm`) cannot be imported, whatever this
# host has installed: None in sys.modules makes its import raise ModuleNotFoundError.
CHILD = """
import sys
sys.modules[{blocked!r}] = None
try:
    import kvwarden.vllm
except ModuleNotFoundError as error:
    print(error.name)
    print(error)
"""


@pytest.mark.parametrize("blocked", ["torch", "vllm"])
def test_import_without_the_vllm_extra_names_the_pip_install(blocked):
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(blocked=blocked)],
        capture_output=True,
        text=True,
        check=True,
    )
    name, message = child.stdout.split("\n", 1)
    if blocked == "vllm" and name == "torch":
        pytest.skip("torch is missing here too: the torch case covers the message")
    assert name == blocked, child.stdout
    assert "pip install './python[vllm]'" in message, message
    assert f"{blocked!r} is not installed" in message, message
