"""Dependencies that cannot drift under a fresh install, and the warnings a run printed fixed
at their cause: every requirement bounded above, the installed versions inside the ranges,
SGLang 0.5.23's own pins inside them (the [sglang] extra installs beside moe_rl), and the
deprecated calls gone (transformers' `past_key_values`, megatron's "full" CUDA-graph scope)."""
import importlib.metadata
import os
import subprocess
import sys
import warnings

from packaging.requirements import Requirement

from tests.helpers import setup_lists

# from sglang-0.5.23.dist-info/METADATA (Requires-Dist): what it pins exactly
SGLANG_0_5_23_PINS = {"transformers": "5.19.0", "tokenizers": "0.23.2", "torch": "2.14.1"}


def test_every_requirement_has_a_range_with_an_upper_bound():
    lists = setup_lists()
    reqs = [*lists["install_requires"], *(r for v in lists["extras_require"].values() for r in v)]
    for text in reqs:
        req = Requirement(text)
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "<" in ops, f"{text}: expected a range >=LOW,<HIGH"


def test_installed_versions_lie_in_the_ranges_and_sglangs_pins_too():
    for text in setup_lists()["install_requires"]:
        req = Requirement(text)
        version = importlib.metadata.version(req.name)
        assert req.specifier.contains(version.split("+")[0], prereleases=True), \
            f"{req.name} {version} outside {req.specifier}"
        if req.name in SGLANG_0_5_23_PINS:
            assert req.specifier.contains(SGLANG_0_5_23_PINS[req.name]), \
                f"{req.name}: SGLang 0.5.23 pins {SGLANG_0_5_23_PINS[req.name]}, outside {req}"


def test_no_deprecation_warning_from_the_engine_or_the_trainer_config(tmp_path):
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    from moe_rl.families.shape import model_spec
    from moe_rl.trainer.model_builder import load_hf_config, transformer_config
    from tests.helpers import write_tiny_qwen
    import megatron.core.transformer   # noqa: F401  (its import-time warnings are not ours)
    write_tiny_qwen(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        warnings.filterwarnings("error", message=".*deprecated.*")
        engine = ReferenceEngine(str(tmp_path / "m"))
        out = engine.run([Request([1, 2, 3], SamplingParams(max_new_tokens=3, sampling_seed=0),
                                  "r0")])
        transformer_config(model_spec(load_hf_config(str(tmp_path / "m"))))
    assert len(out[0]["output_ids"]) >= 1


RAY_RUN = """
import ray
from moe_rl.orchestration.ray_placement import choose_local_ray_auth
choose_local_ray_auth()                     # after `import ray`, as in a test process
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
print("answer", ray.get(ray.remote(lambda: 41 + 1).remote()))
ray.shutdown()
"""


def test_the_run_chooses_rays_authentication_and_ray_says_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["HOME"] = str(tmp_path)          # Ray writes its token under ~/.ray
    res = subprocess.run([sys.executable, "-c", RAY_RUN], env=env, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0 and "answer 42" in res.stdout, res.stderr[-3000:]
    assert "Token authentication" not in res.stderr, res.stderr[-3000:]
    assert (tmp_path / ".ray" / "auth_token").is_file()


def test_a_users_ray_auth_mode_is_kept(monkeypatch):
    from moe_rl.orchestration.ray_placement import choose_local_ray_auth
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    choose_local_ray_auth()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
