"""MoE experts: each expert is its own Muon unit, or the layout is refused in one line."""

import pytest
import torch

from megatron_muon.megatron.params import (check_expert_layout, is_muon_matrix,
                                           layer_weights_not_2d)


def _legacy_grouped_mlp(num_experts=4, hidden=8, ffn=6):
    """Megatron's legacy GroupedMLP as it stores its experts (its constructor needs the
    GPU-only grouped_gemm package): weight1 (hidden, E * ffn), weight2 (E * ffn, hidden)."""
    from megatron.core.transformer.moe import experts

    if not hasattr(experts, "GroupedMLP"):
        pytest.skip("this megatron-core has no legacy GroupedMLP")
    module = experts.GroupedMLP.__new__(experts.GroupedMLP)
    torch.nn.Module.__init__(module)
    module.weight1 = torch.nn.Parameter(torch.zeros(hidden, num_experts * ffn))
    module.weight2 = torch.nn.Parameter(torch.zeros(num_experts * ffn, hidden))
    return module


def test_legacy_grouped_mlp_is_refused_not_orthogonalised_jointly():
    """Its weight1 is 2-D and inside a layer, so Muon would take all experts as one matrix
    (and expert i's matrix is a reshape of a flat block, not a block of that tensor)."""
    layers = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Module()])})
    layers["layers"][0].experts = _legacy_grouped_mlp()
    name = "layers.0.experts.weight1"
    assert is_muon_matrix(name, dict(layers.named_parameters())[name])  # what it would do
    with pytest.raises(ValueError, match=r"layers\.0\.experts is Megatron's legacy GroupedMLP.*"
                                         r"TEGroupedMLP.*SequentialMLP"):
        check_expert_layout(layers.named_parameters(), layers.named_modules())


def test_weights_of_more_than_two_dimensions_are_refused_unless_sent_to_adamw():
    named = [("decoder.layers.0.mlp.experts.weight", torch.nn.Parameter(torch.zeros(4, 6, 8)))]
    with pytest.raises(ValueError, match=r"experts\.weight has shape \(4, 6, 8\).*"
                                         "--dmuon-adam-params"):
        check_expert_layout(named, [])
    check_expert_layout(named, [], extra_adam=r"experts\.weight$")  # the user's choice
    # per-expert 2-D weights (TEGroupedMLP's weight{i}, SequentialMLP) pass, one unit each
    per_expert = [(f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}",
                   torch.nn.Parameter(torch.zeros(6, 8))) for i in range(4)]
    check_expert_layout(per_expert, [])
    assert all(is_muon_matrix(n, p) for n, p in per_expert)


def test_layer_weights_of_more_than_two_dimensions_go_to_the_scalar_optimizer():
    """Mamba's 3-D ``conv1d.weight`` (hybrid models) is no expert stack: like Megatron's
    own Muon, it goes to AdamW / Lion (the factory logs the names once), where before it met
    an error about experts."""
    conv = ("decoder.layers.1.mixer.conv1d.weight", torch.nn.Parameter(torch.zeros(16, 1, 4)))
    check_expert_layout([conv], [])
    assert not is_muon_matrix(*conv)
    assert layer_weights_not_2d([conv, ("embedding.word_embeddings.weight",
                                        torch.nn.Parameter(torch.zeros(4, 3, 2)))]) == [conv[0]]
