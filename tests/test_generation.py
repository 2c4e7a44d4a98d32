"""explain_generation: a map per generated token of tiny random LLaVA and LLaVA-NeXT models.

The models, the tokenizer (a WordLevel vocabulary with the image token, built with the
``tokenizers`` package) and the processors are made offline. Each per-token map is checked
against a hand reference. Grad-CAM: the projector's output replaced by a leaf tensor in an
ordinary grad-enabled forward pass, the token's logit differentiated with respect to it, and
Grad-CAM's formula written out (the mean gradient over the patches weighs the channels). The
attention methods: the language model's attention returned by an ``eager`` pass with
``output_attentions=True``, each token's logit differentiated with respect to it, the
formulas of ``test_attention_methods`` on the whole matrices, and the row of the position
that predicted the token at the base image's columns; camviz explains the model in ``sdpa``
mode (its fused attention computed explicitly) and hands it back in its mode.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from PIL import Image
from test_attention_methods import (
    attention_settings,
    hand_chefer,
    hand_gradient_rollout,
    hand_rollout,
)

import camviz
from camviz.cams.llava import base_window, llava_of
from camviz.core.maps import normalize

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<unk>", "<pad>", "</s>", "<image>", "USER:", "ASSISTANT:", "what", "is", "this"]
WORDS += ["a", "cat", "dog", "red", "blue", "sky", "the", "on", "in", "big", "small"]
PROMPT = "USER: <image> what is this ASSISTANT:"
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
NEW_TOKENS = 4
IMAGE = WORDS.index("<image>")


def _tokenizer():
    vocabulary = {word: index for index, word in enumerate(WORDS)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens(["<image>", "<pad>", "</s>"])  # "<image>" repeats without spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )


def _configs(strategy: str = "default") -> dict:
    vision = transformers.CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    text = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        pad_token_id=1,
        eos_token_id=2,
    )
    return {
        "vision_config": vision,
        "text_config": text,
        "image_token_id": IMAGE,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": strategy,
    }


def _processor_options(strategy: str = "default") -> dict:
    return {
        "tokenizer": _tokenizer(),
        "patch_size": 8,
        "vision_feature_select_strategy": strategy,
        "num_additional_image_tokens": 1,
    }


def _ready(model, processor):
    """A random model that does not stop at once (no end token, so T tokens come out),
    run once: transformers hooks its layers for good on a model's first call, which the
    checks of the model's state would see."""
    model.generation_config.eos_token_id = None
    photo = Image.new("RGB", (32, 32))
    with torch.no_grad():
        model(**processor(images=photo, text=PROMPT, return_tensors="pt"))
    return model.eval(), processor


def _llava(strategy: str):
    torch.manual_seed(0)
    config = transformers.LlavaConfig(**_configs(strategy))
    model = transformers.LlavaForConditionalGeneration(config)
    images = transformers.LlavaImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    options = _processor_options(strategy)
    return _ready(model, transformers.LlavaProcessor(image_processor=images, **options))


@pytest.fixture(scope="module")
def llava():
    return _llava("default")


@pytest.fixture(scope="module")
def llava_with_class_token():
    """vision_feature_select_strategy="full": the projector also gets the class token."""
    return _llava("full")


@pytest.fixture(scope="module")
def llava_next():
    torch.manual_seed(1)
    config = transformers.LlavaNextConfig(**_configs(), image_grid_pinpoints=PINPOINTS)
    model = transformers.LlavaNextForConditionalGeneration(config)
    images = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=PINPOINTS,
    )
    processor = transformers.LlavaNextProcessor(image_processor=images, **_processor_options())
    return _ready(model, processor)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _hand_references(model, processor, photo, token_ids):
    """Per token: its logit's gradient at the projector's output (a leaf in a plain
    grad-enabled pass), the raw Grad-CAM map of the base image's 4 x 4 patches, and the
    teacher-forced logits."""
    inputs = processor(images=photo, text=PROMPT, return_tensors="pt")
    sequence = torch.cat([inputs["input_ids"], token_ids[None]], dim=1)
    projector = model.model.multi_modal_projector
    with torch.no_grad():
        projected = projector(_projector_input(model, inputs))
    leaf = projected.clone().requires_grad_(True)
    handle = projector.register_forward_hook(lambda module, args, output: leaf)
    try:
        extra = {
            key: value
            for key, value in inputs.items()
            if key not in ("input_ids", "attention_mask")
        }
        logits = model(input_ids=sequence, **extra).logits[0]
    finally:
        handle.remove()
    start = inputs["input_ids"].shape[1] - 1
    first = 1 if model.config.vision_feature_select_strategy == "full" else 0  # class token
    maps = []
    for t, token in enumerate(token_ids.tolist()):
        (gradient,) = torch.autograd.grad(logits[start + t, token], leaf, retain_graph=True)
        weights = gradient[0, first:].mean(dim=0)  # alpha_k = mean over the patches of dy/dA^k
        maps.append((projected[0, first:] @ weights).reshape(4, 4))  # sum_k alpha_k A^k
    return torch.stack(maps), logits[start : start + len(token_ids)].detach()


def _projector_input(model, inputs):
    """The vision tower's tokens for every view of the image, without the class token
    unless the model keeps it."""
    pixels = inputs["pixel_values"]
    if pixels.dim() == 5:  # LLaVA-NeXT: (1, views, 3, h, w)
        pixels = pixels[0]
    hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1]
    return hidden if model.config.vision_feature_select_strategy == "full" else hidden[:, 1:]


@pytest.mark.parametrize("kind", ["llava", "llava_with_class_token", "llava_next"])
def test_each_token_map_is_grad_cam_of_its_logit_at_the_projector(kind, request, photo, untouched):
    model, processor = request.getfixturevalue(kind)
    inputs = processor(images=photo, text=PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    model.train()  # handed back in train mode, with a frozen parameter
    model.model.multi_modal_projector.linear_1.bias.requires_grad_(False)
    try:
        with untouched(model):
            generation = camviz.explain_generation(
                model, processor, photo, PROMPT, max_new_tokens=NEW_TOKENS
            )
    finally:
        model.model.multi_modal_projector.linear_1.bias.requires_grad_(True)
        model.eval()

    assert generation.token_ids.tolist() == expected[0, inputs["input_ids"].shape[1] :].tolist()
    assert generation.tokens == [WORDS[token] for token in generation.token_ids.tolist()]

    maps, logits = _hand_references(model, processor, photo, generation.token_ids)
    assert logits.argmax(dim=1).tolist() == generation.token_ids.tolist()  # greedy
    scores = logits.gather(1, generation.token_ids[:, None])[:, 0]
    torch.testing.assert_close(generation.scores, scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(generation.layer_maps, maps, rtol=1e-5, atol=1e-6)
    assert generation.heatmaps.shape == (NEW_TOKENS, photo.height, photo.width)
    if kind == "llava_next":  # the base image is the whole photo stretched: a plain upsample
        laid = F.interpolate(normalize(maps.clamp_min(0))[:, None], size=(40, 56), mode="bilinear")
        torch.testing.assert_close(generation.heatmaps, laid[:, 0], rtol=1e-5, atol=1e-6)


def test_the_window_is_where_the_processor_puts_the_photo(llava, llava_next):
    """A photo whose red channel counts columns and green channel rows: after the processor,
    each processed pixel's colour names the photo pixel it came from, and the window of
    base_window must put it at the same place (interpolation keeps a ramp a ramp)."""
    rows, columns = np.mgrid[0:40, 0:56]
    ramp = np.stack([columns * 4, rows * 4, np.zeros_like(rows)], axis=-1).astype(np.uint8)
    photo = Image.fromarray(ramp)
    padding = llava[1].image_processor
    for model, processor, pad in [(*llava, False), (*llava, True), (*llava_next, None)]:
        try:
            if pad is not None:  # LLaVA's pad to a square (LLaVA-NeXT's do_pad pads batches)
                padding.do_pad = pad
            processed = processor.image_processor(photo, do_normalize=False, return_tensors="pt")
            pixels = processed["pixel_values"][0]
            window = base_window(processor, llava_of(model), (40, 56), tuple(pixels.shape[-2:]))
        finally:
            padding.do_pad = False
        pixels = pixels[0] if pixels.dim() == 4 else pixels  # LLaVA-NeXT's base image
        centres = torch.arange(32, dtype=torch.float64) + 0.5
        seen_x = window.left + centres * window.width / 32 - 0.5  # photo column of each one
        seen_y = window.top + centres * window.height / 32 - 0.5
        got_x, got_y = pixels[0].double() * 255 / 4, pixels[1].double() * 255 / 4
        inside_x = (seen_x > 2) & (seen_x < 53)  # clear of the ramp's ends and of padding
        inside_y = (seen_y > 2) & (seen_y < 37)
        torch.testing.assert_close(got_x[16, inside_x], seen_x[inside_x], atol=0.35, rtol=0)
        torch.testing.assert_close(got_y[inside_y, 16], seen_y[inside_y], atol=0.35, rtol=0)


def test_what_the_processor_cropped_away_has_no_map(llava, photo):
    generation = camviz.explain_generation(*llava, photo, PROMPT, max_new_tokens=1)
    # shortest edge 32: the photo is 32 x 44, its centre 32 columns kept, from column 6 of 44
    left, width = 6 * 56 / 44, 32 * 56 / 44
    columns = torch.arange(56) + 0.5
    outside = (columns < left) | (columns > left + width)
    assert generation.heatmaps[0][:, outside].abs().max() == 0
    assert generation.heatmaps[0][:, ~outside].amin() >= 0
    assert generation.heatmaps[0][:, ~outside].amax() > 0


def _failing_after_decoding():
    """A forward hook for the head that raises in the teacher-forced pass, after the
    decoding steps have called it once per new token, and the list of its calls."""
    calls: list[int] = []

    def fail_after_decoding(module, args, output):
        calls.append(1)
        if len(calls) > NEW_TOKENS:
            raise RuntimeError("the user's hook failed")

    return fail_after_decoding, calls


def test_an_error_in_the_explaining_pass_leaves_the_model_as_it_came(llava, photo, untouched):
    """The user's own hook on the head fails in the teacher-forced pass (after the decoding
    steps): a ModelError, and the tap and eval mode are undone."""
    model, processor = llava
    fail_after_decoding, calls = _failing_after_decoding()
    handle = model.lm_head.register_forward_hook(fail_after_decoding)
    model.train()
    try:
        with untouched(model), pytest.raises(camviz.ModelError, match="the user's hook failed"):
            camviz.explain_generation(model, processor, photo, PROMPT, max_new_tokens=NEW_TOKENS)
    finally:
        handle.remove()
        model.eval()
    assert len(calls) == NEW_TOKENS + 1


def test_one_line_errors(llava, photo):
    model, processor = llava
    with pytest.raises(camviz.CamvizError, match="LLaVA-style model"):
        camviz.explain_generation(torch.nn.Linear(2, 2), processor, photo, PROMPT)
    with pytest.raises(camviz.CamvizError, match="method='gradcam' or 'attention_rollout'"):
        camviz.explain_generation(model, processor, photo, PROMPT, method="scorecam")
    with pytest.raises(camviz.CamvizError, match="attention_rollout has no option 'layer'"):
        camviz.explain_generation(
            model, processor, photo, PROMPT, method="attention_rollout", layer="x"
        )
    with pytest.raises(camviz.CamvizError, match="PIL image"):
        camviz.explain_generation(model, processor, np.asarray(photo), PROMPT)
    with pytest.raises(camviz.CamvizError, match="needs one '<image>' where the image goes"):
        camviz.explain_generation(model, processor, photo, "USER: what is this ASSISTANT:")
    with pytest.raises(camviz.CamvizError, match="positive int"):
        camviz.explain_generation(model, processor, photo, PROMPT, max_new_tokens=0)


def test_token_figure_draws_each_token_over_its_overlay(llava, photo):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    generation = camviz.explain_generation(*llava, photo, PROMPT, max_new_tokens=3)

    def pixels(figure) -> np.ndarray:
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        return np.asarray(canvas.buffer_rgba())[..., :3].astype(int)

    figure = camviz.render.token_figure(photo, generation)
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == [token.strip() for token in generation.tokens]
    blank = camviz.Generation(
        **{**vars(generation), "heatmaps": torch.zeros_like(generation.heatmaps)}
    )
    drawn, without_maps = pixels(figure), pixels(camviz.render.token_figure(photo, blank))
    assert drawn.shape == without_maps.shape
    assert np.abs(drawn - without_maps).max() > 50  # the overlays' colours are drawn


# --- the attention methods on the language model's attention ------------------------------


@contextlib.contextmanager
def _attention_implementation(model, implementation: str):
    """Every Hugging Face config of the model set to ``implementation`` for the block, each
    put back as it was."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        pending = [config] if config is not None else []
        while pending:
            config = pending.pop()
            configs[id(config)] = (config, config._attn_implementation)
            pending += [getattr(config, key) for key in getattr(config, "sub_configs", {})]
    for config, _ in configs.values():
        config._attn_implementation = implementation
    try:
        yield
    finally:
        for config, before in configs.values():
            config._attn_implementation = before


def _eager_attention(model, processor, photo):
    """The greedy tokens (in the model's own sdpa mode), then from an eager pass over the
    prompt and them: each language-model block's attention ``(1, H, L, L)``, per token the
    gradients of its logit with respect to them, the position that predicts the first one,
    and the positions of the base image's patch tokens (the first 16 image tokens: LLaVA-NeXT
    writes its base image first, then its tiles and newlines)."""
    inputs = processor(images=photo, text=PROMPT, return_tensors="pt")
    with torch.no_grad():
        sequence = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    extra = {key: value for key, value in inputs.items() if key not in ("input_ids",)}
    extra["attention_mask"] = torch.ones_like(sequence)
    with _attention_implementation(model, "eager"):
        output = model(input_ids=sequence, **extra, output_attentions=True)
    attentions = output.attentions
    assert len(attentions) == 2 and attentions[0].shape[-1] == sequence.shape[1]
    start = inputs["input_ids"].shape[1] - 1
    generated = sequence[0, start + 1 :].tolist()
    gradients = [
        torch.autograd.grad(output.logits[0, start + t, token], attentions, retain_graph=True)
        for t, token in enumerate(generated)
    ]
    image = (inputs["input_ids"][0] == IMAGE).nonzero()[:, 0]
    return {
        "attentions": [attention.detach() for attention in attentions],
        "gradients": gradients,
        "generated": generated,
        "start": start,
        "columns": image[:16],
    }


@pytest.fixture(scope="module")
def llava_attention(llava, photo):
    return _eager_attention(*llava, photo)


def _hand_maps(reference, hand) -> torch.Tensor:
    """Per token, the row of the position that predicted it of ``hand(attentions, its
    gradients)`` at the base image's columns, on the 4 x 4 patch grid."""
    maps = []
    for t, gradients in enumerate(reference["gradients"]):
        relevance = hand(reference["attentions"], list(gradients))[0]
        maps.append(relevance[reference["start"] + t, reference["columns"]].reshape(4, 4))
    return torch.stack(maps)


ATTENTION_METHODS = {
    "attention_rollout": (hand_rollout, {}),
    "attention_rollout-max-discard": (
        lambda a, g: hand_rollout(a, g, "max", 0.6),
        {"head_fusion": "max", "discard_ratio": 0.6},
    ),
    "gradient_rollout": (hand_gradient_rollout, {}),
    "gradient_rollout-discard": (
        lambda a, g: hand_gradient_rollout(a, g, 0.9),
        {"discard_ratio": 0.9},
    ),
    "transformer_attribution": (hand_chefer, {}),
}


@pytest.mark.parametrize("case", list(ATTENTION_METHODS))
def test_each_token_attention_map_is_its_row_of_the_formula(
    case, llava, llava_attention, photo, untouched
):
    model, processor = llava
    hand, options = ATTENTION_METHODS[case]
    method = case.partition("-")[0]
    settings = attention_settings(model)
    assert model.config.text_config._attn_implementation == "sdpa"
    with untouched(model):
        generation = camviz.explain_generation(
            model, processor, photo, PROMPT, max_new_tokens=NEW_TOKENS, method=method, **options
        )
    assert attention_settings(model) == settings
    assert generation.method == method
    assert generation.token_ids.tolist() == llava_attention["generated"]
    maps = _hand_maps(llava_attention, hand)
    torch.testing.assert_close(generation.layer_maps, maps, rtol=1e-5, atol=1e-8)
    if options:  # the options change the map by ten times the tolerance: not ignored
        plain = _hand_maps(llava_attention, ATTENTION_METHODS[method][0])
        assert not torch.allclose(maps, plain, rtol=1e-4, atol=0)
    inputs = processor(images=photo, text=PROMPT, return_tensors="pt")
    window = base_window(
        processor, llava_of(model), (40, 56), tuple(inputs["pixel_values"].shape[-2:])
    )
    laid = window.lay(normalize(maps.clamp_min(0)))  # as the Grad-CAM maps are laid
    torch.testing.assert_close(generation.heatmaps, laid, rtol=1e-5, atol=1e-6)


def test_llava_next_attention_maps_read_the_base_image_only(llava_next, photo, untouched):
    """Its image span is 16 base tokens, then tiles with newline tokens: the map is the
    base image's 16 columns, laid over the whole (stretched) photo."""
    model, processor = llava_next
    reference = _eager_attention(model, processor, photo)
    image_tokens = processor(images=photo, text=PROMPT, return_tensors="pt")["input_ids"] == IMAGE
    assert image_tokens.sum() > 16  # tiles and newlines after the base image
    with untouched(model):
        generation = camviz.explain_generation(
            model, processor, photo, PROMPT, max_new_tokens=NEW_TOKENS, method="gradient_rollout"
        )
    maps = _hand_maps(reference, hand_gradient_rollout)
    torch.testing.assert_close(generation.layer_maps, maps, rtol=1e-5, atol=1e-8)
    laid = F.interpolate(normalize(maps.clamp_min(0))[:, None], size=(40, 56), mode="bilinear")
    torch.testing.assert_close(generation.heatmaps, laid[:, 0], rtol=1e-5, atol=1e-6)


def test_an_eager_model_comes_back_eager_also_after_an_error_mid_pass(
    llava, llava_attention, photo, untouched
):
    """Explained in eager mode, the map is the same (the pass switched it to the fused call
    and computed that explicitly); a failure in the explaining pass leaves it eager too."""
    model, processor = llava
    fail_after_decoding, calls = _failing_after_decoding()

    def explain(method):
        return camviz.explain_generation(
            model, processor, photo, PROMPT, max_new_tokens=NEW_TOKENS, method=method
        )

    with _attention_implementation(model, "eager"):
        settings = attention_settings(model)
        with untouched(model):
            generation = explain("transformer_attribution")
        assert attention_settings(model) == settings
        maps = _hand_maps(llava_attention, hand_chefer)
        torch.testing.assert_close(generation.layer_maps, maps, rtol=1e-5, atol=1e-8)
        handle = model.model.language_model.layers[-1].register_forward_hook(fail_after_decoding)
        try:
            with untouched(model), pytest.raises(camviz.ModelError, match="the user's hook"):
                explain("attention_rollout")
        finally:
            handle.remove()
        assert attention_settings(model) == settings
        assert len(calls) == NEW_TOKENS + 1
