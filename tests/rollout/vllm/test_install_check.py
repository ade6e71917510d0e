"""What the config check tells a user whose machine cannot run vLLM, before anything starts."""

from hybridflow.rollout.vllm.install import INSTALL_HINT, install_problem, unsupported_head_size


def test_an_installed_working_vllm_has_no_problem():
    assert install_problem() is None  # make test installs vLLM's CPU build and removes the broken companions


def test_a_missing_package_is_named_with_the_install_command():
    assert install_problem("hybridflow_no_such_package") == "hybridflow_no_such_package is not installed"
    assert "pip install 'hybridflow[vllm]'" in INSTALL_HINT
    assert "pip uninstall -y torchvision torchaudio torchcodec" in INSTALL_HINT


def test_a_companion_that_fails_to_load_is_named(tmp_path, monkeypatch):
    """A package that raises on import, as PyPI's torchvision does beside the CPU torch."""
    broken = tmp_path / "hybridflow_broken_vision"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = install_problem("vllm", companions=("hybridflow_broken_vision",))
    assert problem == (
        "hybridflow_broken_vision is installed but does not load beside this torch "
        "(RuntimeError: operator torchvision::nms does not exist)"
    )


def test_head_sizes_of_the_cpu_kernels():
    assert unsupported_head_size(64, "cpu") is None  # SmolLM2-135M
    assert unsupported_head_size(32, "cpu") is None
    assert "this model's is 16" in unsupported_head_size(16, "cpu")
    assert unsupported_head_size(16, "cuda") is None  # not checked for GPU backends
