"""Fixtures shared by the trainer's tests."""
import pytest

from tests.helpers import write_tiny_qwen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "qwen"
    model = write_tiny_qwen(path)
    return str(path), model
