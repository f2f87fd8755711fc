"""`moe-rl plan`'s line on the experts' computation (moe_rl/commands/plan.py): what the trainer
will build, and, on a machine without Transformer Engine, where TE's grouped experts would run
instead (the trainer's machine decides)."""
import subprocess
import sys


def _experts_line(*overrides: str) -> str:
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "plan", "--config",
                          "qwen3_30b_a3b_r3_gspo.yaml", "--no-inputs", *overrides],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return next(line for line in res.stdout.splitlines() if line.startswith("trainer experts"))


def test_plan_says_which_expert_path_runs_and_where_te_would():
    assert _experts_line() == (
        "trainer experts: grouped (torch._grouped_mm over the local experts; te_grouped where "
        "the trainer's machine has Transformer Engine and CUDA)")
    assert _experts_line("trainer.experts=te_grouped").startswith(
        "trainer experts: te_grouped where the trainer's machine has Transformer Engine")
    assert _experts_line("trainer.experts=sequential").startswith("trainer experts: sequential")
