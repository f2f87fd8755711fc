"""The memory-bounded log-prob/entropy kernel against a float64 full-softmax reference."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from moe_rl_kernels.logprob import logprob_entropy
from tests.helpers import start_ranks


def reference(hidden, weight, targets, temperature=1.0, sets=None):
    """float64 full log_softmax, restricted per row to ``sets[t]`` when given and non-empty."""
    z = (hidden.double() @ weight.double().t()) / temperature
    lps, ents = [], []
    for t in range(z.shape[0]):
        row = z[t]
        if sets is not None and sets[t]:
            keep = torch.full_like(row, -torch.inf)
            keep[sets[t]] = row[sets[t]]
            row = keep
        logp = torch.log_softmax(row, -1)
        p = logp.exp()
        lps.append(logp[targets[t]])
        ents.append(-(p[p > 0] * logp[p > 0]).sum())
    return torch.stack(lps), torch.stack(ents)


def ragged(sets):
    off, ids = [0], []
    for s in sets:
        ids += s
        off.append(len(ids))
    return torch.tensor(off), torch.tensor(ids, dtype=torch.int32)


def data(T=7, H=5, V=11, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g, dtype=dtype), torch.randn(V, H, generator=g, dtype=dtype),
            torch.randint(0, V, (T,), generator=g))


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_reference(chunk, temperature):
    h, w, t = data()
    lp, ent = logprob_entropy(h, w, t, temperature=temperature, chunk_size=chunk)
    rlp, rent = reference(h, w, t, temperature)
    assert torch.allclose(lp, rlp, atol=1e-12) and torch.allclose(ent, rent, atol=1e-12)


def test_hand_worked_case():
    # logits [0, ln 3] -> p = [1/4, 3/4]
    h = torch.tensor([[1.0]], dtype=torch.float64)
    w = torch.tensor([[0.0], [float(torch.log(torch.tensor(3.0)))]], dtype=torch.float64)
    lp, ent = logprob_entropy(h, w, torch.tensor([1]))
    assert float(lp) == pytest.approx(float(torch.log(torch.tensor(0.75))))
    assert float(ent) == pytest.approx(-(0.25 * float(torch.log(torch.tensor(0.25)))
                                         + 0.75 * float(torch.log(torch.tensor(0.75)))))


def test_a_minus_inf_logit_adds_nothing():
    """A -inf logit has probability 0: the entropy and log-probs are those of the other tokens
    (not NaN from 0 * -inf), and the logit gradient there is 0 (the chunk's backward)."""
    from moe_rl_kernels.logprob_torch import chunk_logit_grad
    h = torch.tensor([[1.0], [0.5]], dtype=torch.float64)
    w = torch.tensor([[0.0], [float(torch.log(torch.tensor(3.0)))], [-torch.inf]],
                     dtype=torch.float64)
    t = torch.tensor([1, 0])
    lp, ent = logprob_entropy(h, w, t)
    rlp, rent = reference(h, w, t)
    assert torch.isfinite(ent).all() and torch.allclose(ent, rent, atol=1e-12)
    assert torch.allclose(lp, rlp, atol=1e-12)
    # row 0 by hand: p = [1/4, 3/4, 0]
    assert float(ent[0]) == pytest.approx(-(0.25 * float(torch.log(torch.tensor(0.25)))
                                            + 0.75 * float(torch.log(torch.tensor(0.75)))))
    logits = h @ w.t()
    lse = torch.logsumexp(logits, -1)
    gz = chunk_logit_grad(logits.clone(), 1.0, lse, ent, torch.ones(2, dtype=torch.float64),
                          torch.ones(2, dtype=torch.float64), t, None, None, 0, 2, 0)
    assert torch.isfinite(gz).all() and (gz[:, 2] == 0).all()


def test_kept_sets_match_reference():
    h, w, t = data(T=5, V=9)
    sets = [[int(t[0]), 2, 7], [], [int(t[2])], list(range(9)), [int(t[4]), 0]]
    off, ids = ragged(sets)
    lp, ent = logprob_entropy(h, w, t, temperature=0.8, kept_offsets=off, kept_ids=ids,
                              chunk_size=2)
    rlp, rent = reference(h, w, t, 0.8, sets)
    assert torch.allclose(lp, rlp, atol=1e-12) and torch.allclose(ent, rent, atol=1e-12)


@pytest.mark.parametrize("with_sets", [False, True])
def test_gradcheck_float64(with_sets):
    h, w, t = data(T=6, H=4, V=7, seed=3)
    kw = {}
    if with_sets:
        sets = [[int(t[0]), 1], [], [int(t[2]), 3, 4], [int(t[3])], [], [int(t[5]), 6, 0]]
        off, ids = ragged(sets)
        kw = dict(kept_offsets=off, kept_ids=ids)

    def f(hh, ww):
        lp, ent = logprob_entropy(hh, ww, t, temperature=1.3, chunk_size=4, **kw)
        return (lp * torch.linspace(0.5, 1.5, 6, dtype=torch.float64)).sum() + 0.3 * ent.sum()
    assert torch.autograd.gradcheck(f, (h.requires_grad_(), w.requires_grad_()))


def test_gradients_match_autograd_of_reference():
    h, w, t = data(T=9, H=6, V=13, seed=5)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = logprob_entropy(h1, w1, t, chunk_size=4)
    (lp.sum() - 0.1 * ent.sum()).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    z = h2 @ w2.t()
    logp = torch.log_softmax(z, -1)
    (logp.gather(1, t[:, None]).sum() + 0.1 * (logp.exp() * logp).sum()).backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-12) and torch.allclose(w1.grad, w2.grad,
                                                                           atol=1e-12)


def test_bfloat16_inputs_single_row():
    h, w, t = data(T=1, H=8, V=32, dtype=torch.float32)
    lp, ent = logprob_entropy(h.bfloat16(), w.bfloat16(), t)
    rlp, rent = reference(h.bfloat16(), w.bfloat16(), t)
    assert lp.dtype == torch.float32 and lp.shape == (1,)
    assert torch.allclose(lp.double(), rlp, atol=2e-2) and torch.allclose(ent.double(), rent,
                                                                          atol=2e-2)
    hb = h.bfloat16().requires_grad_()
    logprob_entropy(hb, w.bfloat16(), t)[0].sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and torch.isfinite(hb.grad.float()).all()


def test_errors_name_the_argument():
    h, w, t = data()
    with pytest.raises(ValueError, match="hidden"):
        logprob_entropy(h[0], w, t)
    with pytest.raises(ValueError, match="weight"):
        logprob_entropy(h, w[:, :2], t)
    with pytest.raises(ValueError, match="targets"):
        logprob_entropy(h, w, t[:3])
    with pytest.raises(TypeError, match="weight"):
        logprob_entropy(h, w.float(), t)
    with pytest.raises(ValueError, match="temperature"):
        logprob_entropy(h, w, t, temperature=0)
    with pytest.raises(ValueError, match="kept_offsets"):
        logprob_entropy(h, w, t, kept_offsets=torch.tensor([0, 1]), kept_ids=torch.tensor([1]))
    sets = [[int(t[0])]] + [[]] * 5 + [[(int(t[6]) + 1) % 11]]
    with pytest.raises(ValueError, match="row 6"):
        logprob_entropy(h, w, t, kept_offsets=ragged(sets)[0], kept_ids=ragged(sets)[1])
    with pytest.raises(ValueError, match="backend"):
        logprob_entropy(h, w, t, backend="cuda")


# ------------------------------------------------------------------ tensor-parallel vocabulary

def _tp_worker(rank, port, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    h, w, t = data(T=8, H=5, V=12, seed=9)
    sets = [[int(t[0]), 1, 11], [], [int(t[2])], [int(t[3]), 5, 6, 7], [], [], [int(t[6]), 0], []]
    off, ids = ragged(sets)
    lo, hi = (0, 7) if rank == 0 else (7, 12)   # uneven split
    hl = h.clone().requires_grad_()
    wl = w[lo:hi].clone().requires_grad_()
    lp, ent = logprob_entropy(hl, wl, t, temperature=0.9, kept_offsets=off, kept_ids=ids,
                              chunk_size=3, tp_group=dist.group.WORLD, vocab_start=lo)
    (lp.sum() + 0.2 * ent.sum()).backward()
    torch.save({"lp": lp.detach(), "ent": ent.detach(), "gh": hl.grad, "gw": wl.grad,
                "lo": lo, "hi": hi}, os.path.join(result_dir, f"r{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_tensor_parallel_vocab_split_matches_unsplit(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_tp_worker, (port, str(tmp_path)), 2)
    h, w, t = data(T=8, H=5, V=12, seed=9)
    sets = [[int(t[0]), 1, 11], [], [int(t[2])], [int(t[3]), 5, 6, 7], [], [], [int(t[6]), 0], []]
    off, ids = ragged(sets)
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = logprob_entropy(hf, wf, t, temperature=0.9, kept_offsets=off, kept_ids=ids)
    (lp.sum() + 0.2 * ent.sum()).backward()
    for r in range(2):
        out = torch.load(tmp_path / f"r{r}.pt")
        assert torch.allclose(out["lp"], lp.detach(), atol=1e-12)
        assert torch.allclose(out["ent"], ent.detach(), atol=1e-12)
        assert torch.allclose(out["gh"], hf.grad, atol=1e-12)
        assert torch.allclose(out["gw"], wf.grad[out["lo"]:out["hi"]], atol=1e-12)


# ------------------------------------------------------------------ Triton (interpreter on CPU)

TRITON_CHECK = textwrap.dedent("""
    import torch
    from moe_rl_kernels.logprob import logprob_entropy
    g = torch.Generator().manual_seed(0)
    for (T, H, V, temp) in [(5, 4, 37, 1.0), (3, 8, 2100, 0.7)]:
        h = torch.randn(T, H, generator=g)
        w = torch.randn(V, H, generator=g)
        t = torch.randint(0, V, (T,), generator=g)
        out = {}
        for backend in ("torch", "triton"):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = logprob_entropy(hh, ww, t, temperature=temp, chunk_size=2, backend=backend)
            (lp.sum() + 0.5 * ent.sum()).backward()
            out[backend] = (lp, ent, hh.grad, ww.grad)
        for a, b in zip(out["torch"], out["triton"]):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # a -inf logit: finite entropy and a zero logit gradient on both backends
    from moe_rl_kernels.logprob_torch import chunk_statistics, chunk_logit_grad
    from moe_rl_kernels.logprob_triton import triton_statistics, triton_logit_grad
    z = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]])
    t = torch.tensor([1])
    stats = {"torch": chunk_statistics(z.clone(), 1.0, t, None, None, torch.zeros(1, dtype=torch.bool)),
             "triton": triton_statistics(z.clone(), 1.0, t, None, None, torch.zeros(1, dtype=torch.bool))}
    for a, b in zip(stats["torch"], stats["triton"]):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-6), (a, b)
    m, s, sz, tz = stats["torch"]
    lse = m + s.log()
    ent = lse - sz / s
    ones = torch.ones(1)
    g_t = chunk_logit_grad(z.clone(), 1.0, lse, ent, ones, ones, t, None, None, 0, 1, 0)
    g_tr = triton_logit_grad(z.clone(), 1.0, lse, ent, ones, ones, t, None, None, 0, 1, 0)
    assert torch.isfinite(g_tr).all() and g_tr[0, 2] == 0 and torch.allclose(g_t, g_tr, atol=1e-6)
    print("TRITON_OK")
""")


def test_triton_backend_matches_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = pathlib.Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "TRITON_OK" in res.stdout, res.stderr[-3000:]
