"""The CPU mode (megatron_muon/megatron/cpu_mode.py) runs Megatron-Core's CUDA-only paths
on CPU without changing what they compute."""

import torch


def test_activation_recompute_replays_dropout_exactly():
    """Megatron's ``tensor_parallel.checkpoint`` (activation recompute) saves the CUDA RNG
    state in the forward and restores it before re-running the forward in the backward.  On
    CPU its get failed ("Torch not compiled with CUDA enabled"); its set goes through
    ``torch.cuda._lazy_call``, which without CUDA queues the call (and a formatted stack) for
    an initialisation that never comes: one more entry per recomputed layer and microbatch.
    With the CPU mode the "CUDA" generator is the CPU one: the recomputed dropout mask is the
    forward's (the gradient equals the one without recompute, bitwise: the same operations
    on the same numbers in the same order) and nothing is queued."""
    from megatron.core import tensor_parallel

    from megatron_muon.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()

    def layer(x, w):
        return torch.nn.functional.dropout(x @ w, p=0.5, training=True).tanh()

    x = torch.randn(8, 16)
    w = torch.randn(16, 16, requires_grad=True)
    torch.manual_seed(7)
    layer(x, w).pow(2).sum().backward()
    plain = w.grad.clone()
    w.grad = None
    torch.manual_seed(7)
    queued = len(torch.cuda._queued_calls)
    out = tensor_parallel.checkpoint(layer, False, x, w)
    torch.randn(100)  # the RNG moves on between the forward and the backward, as in training
    out.pow(2).sum().backward()
    assert torch.equal(w.grad, plain)
    assert len(torch.cuda._queued_calls) == queued
