"""Params and FLOPs (rectrain.modelcost) against the published figures of resnet50 at 224 px."""

import torchvision

from rectrain import modelcost


def test_resnet50_at_224_has_25_6_m_params_and_4_1_g_multiply_adds_which_torch_counts_as_8_2_gflops():
    got = modelcost.cost(torchvision.models.resnet50(), 224)
    assert got["params"] == 25_557_032 and got["params_m"] == 25.56
    assert 4.0 < got["gmacs"] < 4.2, got
    assert got["flops"] == 2 * round(got["flops"] / 2) and abs(got["gflops"] - 2 * got["gmacs"]) < 1e-2
    assert "2 per multiply-add" in got["unit"] and got["image_size"] == 224


def test_flops_grow_with_the_square_of_the_resolution_and_leave_the_model_in_training_mode():
    model = torchvision.models.resnet18()
    small, large = modelcost.forward_flops(model, 112), modelcost.forward_flops(model, 224)
    assert 3.5 < large / small < 4.0  # the convolutions 4x, the classifier the same
    assert model.training
