"""Text prompts for CLIP-like models (:class:`camviz.TextPrompt`): each prompt's map is a
Grad-CAM of the cosine similarity of the image embedding with that text's embedding.

The references are independent of camviz's path: the model's own ``forward`` on the texts
and the images (its ``image_embeds`` and ``text_embeds``), differentiated by hand
(``thirdparty.hand_gradcam``). CLIP's texts are padded to the longest there (its processor's
way) and camviz pads to the text tower's length, so the equality also shows that CLIP's
embedding does not depend on the padding; SigLIP's are padded to its length, as it was
trained. Chefer's transformer attribution of a prompt is checked against its formula on the
eager attention of the image tower (``test_attention_methods``' hand rule). Models and
tokenizers are tiny and built offline (a ``tokenizers`` word-level
vocabulary), the ``hf:`` folder is saved with ``save_pretrained``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import test_attention_methods as attention
import test_model_sources as sources
import thirdparty as tp
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from PIL import Image
from test_modelstate import assert_same, snapshot

import camviz
from camviz.core.errors import CamvizError, ModelError

pytest.importorskip("transformers")

cli = sources.cli  # the fixture: camviz's CLI in this process, the hub offline
explain, one_line_error, rows = sources.explain, sources.one_line_error, sources.rows

_WORDS = ["a", "photo", "of", "cat", "dog", "fox", "red", "car"]
_TEXTS = ["a photo of a cat", "a red dog", "a fox"]
# The layers the default rule picks (tests/test_thirdparty_models.py): CLIP's last norm
# before its last attention (one class token, a 4 x 4 grid), SigLIP's final norm (no class
# token: its head pools every token).
_CLIP_LAYER = "vision_model.encoder.layers.1.layer_norm1"
_SIGLIP_LAYER = "vision_model.post_layernorm"


def _tokenizer(siglip: bool = False):
    """A word-level tokenizer of ``_WORDS`` with the ids of ``thirdparty``'s text configs
    (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2); SigLIP's returns no attention mask, as its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({word: 4 + index for index, word in enumerate(_WORDS)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=words,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=16,
        model_input_names=["input_ids"] if siglip else ["input_ids", "attention_mask"],
    )


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _hand_maps(model, tokens, pixels, layer, grid, score) -> torch.Tensor:
    """``(K, N, *grid)``: Grad-CAM by hand of ``score(cosines, k)`` for each text ``k``, from
    the model's own forward pass on ``tokens`` and ``pixels``."""

    def cosines(output) -> torch.Tensor:  # (N, K)
        return output.image_embeds @ output.text_embeds.T  # both normalised by the model

    inputs = {**tokens, "pixel_values": pixels}
    count = tokens["input_ids"].shape[0]
    return torch.stack(
        [
            tp.hand_gradcam(model, inputs, layer, lambda out, k=k: score(cosines(out), k), grid)[0]
            for k in range(count)
        ]
    )


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_each_prompt_map_is_a_hand_gradcam_of_its_cosine_in_the_order_given(name, pixels):
    siglip = name == "siglip"
    model = tp.hf_siglip() if siglip else tp.hf_clip()
    tokenizer = _tokenizer(siglip)
    layer = _SIGLIP_LAYER if siglip else _CLIP_LAYER
    grid = tp.tokens(0 if siglip else 1, (4, 4))  # SigLIP has no class token
    padding = {"padding": "max_length", "max_length": 16} if siglip else {"padding": True}
    tokens = tokenizer(_TEXTS, **padding, return_tensors="pt")

    explanation = camviz.explain(
        model, pixels, target=camviz.TextPrompt(_TEXTS, tokenizer), relu=False, normalize=False
    )

    assert explanation.layers == [layer]  # the default layer: patch tokens of the image tower
    hand = _hand_maps(model, dict(tokens), pixels, layer, grid, lambda cos, k: cos[:, k])
    ours = explanation.layer_maps.reshape(2, len(_TEXTS), 4, 4).transpose(0, 1)
    for prompt in range(len(_TEXTS)):
        tp.assert_close_to_hand(ours[prompt], hand[prompt])
    assert not torch.allclose(hand[0], hand[1], rtol=1e-2)  # the order is told apart
    with torch.no_grad():
        output = model(**tokens, pixel_values=pixels)
    cosines = output.image_embeds @ output.text_embeds.T
    torch.testing.assert_close(explanation.scores, cosines.flatten(), rtol=1e-5, atol=1e-6)
    assert explanation.samples.tolist() == [0, 0, 0, 1, 1, 1]
    assert explanation.targets.tolist() == [-1] * 6


def test_a_contrast_of_two_prompts_is_the_difference_of_their_cosines(tokenizer, pixels):
    model = tp.hf_clip()
    target = camviz.Contrast(
        camviz.TextPrompt(_TEXTS[0], tokenizer), camviz.TextPrompt(_TEXTS[1], tokenizer)
    )

    explanation = camviz.explain(
        model, pixels, layer=_CLIP_LAYER, target=target, relu=False, normalize=False
    )

    tokens = dict(tokenizer(_TEXTS[:2], padding=True, return_tensors="pt"))
    grid = tp.tokens(1, (4, 4))
    difference = lambda cos, k: cos[:, 0] - cos[:, 1]  # noqa: E731
    hand = _hand_maps(model, tokens, pixels, _CLIP_LAYER, grid, difference)[0]
    tp.assert_close_to_hand(explanation.layer_maps, hand)


def test_the_model_comes_back_as_it_came_also_after_a_failure_mid_pass(tokenizer, pixels):
    model = tp.hf_clip()
    before = snapshot(model)
    target = camviz.TextPrompt(_TEXTS, tokenizer)

    camviz.explain(model, pixels, target=target, method="gradcampp")
    assert_same(before, snapshot(model))
    assert "forward" not in vars(model)  # answered get_image_features for the pass only

    def fail(module, args, output):
        raise RuntimeError("the model failed in its vision tower")

    handle = model.vision_model.encoder.layers[0].register_forward_hook(fail)
    try:
        with pytest.raises(ModelError, match="failed in its vision tower"):
            camviz.explain(model, pixels, layer=_CLIP_LAYER, target=target)
    finally:
        handle.remove()
    assert_same(before, snapshot(model))
    assert "forward" not in vars(model)


def test_what_a_prompt_cannot_do_is_one_line(pixels, tokenizer):
    messages = []
    for model, target in [
        (tp.hf_clip(), camviz.TextPrompt("a cat")),  # no tokenizer
        (tp.hf_vit(), camviz.TextPrompt("a cat", tokenizer)),  # no text tower
    ]:
        with pytest.raises(CamvizError) as raised:
            camviz.explain(model, pixels, target=target)
        messages.append(str(raised.value))
    with pytest.raises(CamvizError) as raised:
        camviz.TextPrompt(["a cat", " "])
    messages.append(str(raised.value))
    assert all("\n" not in message for message in messages), messages
    assert "tokenizer=" in messages[0] and "hf:DIR" in messages[0]
    assert "CLIP-like" in messages[1] and "ViTForImageClassification" in messages[1]
    assert "non-empty texts" in messages[2]


def test_transformer_attribution_of_prompts_is_chefers_rule_on_the_image_tower(tokenizer, pixels):
    model = tp.hf_clip()
    implementations = [config._attn_implementation for config in _configs(model)]
    explanation = camviz.explain(
        model,
        pixels,
        "transformer_attribution",
        target=camviz.TextPrompt(_TEXTS[:2], tokenizer),
        relu=False,
        normalize=False,
    )

    assert [config._attn_implementation for config in _configs(model)] == implementations
    assert explanation.layers == ["vision_model.encoder.layers.1"]  # the last block
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")  # the attention probabilities, in the graph
    with torch.no_grad():
        output = eager(
            **tokenizer(_TEXTS[:2], padding=True, return_tensors="pt"), pixel_values=pixels
        )
    hand = []
    for text in output.text_embeds:
        vision = eager.vision_model(pixel_values=pixels, output_attentions=True)
        image = eager.visual_projection(vision.pooler_output)
        score = F.cosine_similarity(image, text.unsqueeze(0), dim=-1).sum()
        gradients = torch.autograd.grad(score, vision.attentions)
        attentions = [a.detach() for a in vision.attentions]
        hand.append(attention.patch_map(attention.hand_chefer(attentions, gradients), 1))
    expected = torch.stack(hand, dim=1).flatten(0, 1)  # image-major, prompts in order
    assert not torch.allclose(hand[0], hand[1], rtol=1e-2)  # the prompts' order is told apart
    torch.testing.assert_close(explanation.layer_maps, expected, rtol=1e-5, atol=1e-7)


def _configs(model):
    """A CLIP model's config and its towers' (the attention settings camviz switches)."""
    return [model.config, model.config.text_config, model.config.vision_config]


# --- hf: folders --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory, tokenizer) -> Path:
    """The tiny CLIP saved with its tokenizer and an image processor of its 32 px."""
    from transformers import CLIPImageProcessor

    path = tmp_path_factory.mktemp("clip-prompts")
    tp.hf_clip().save_pretrained(path)
    tokenizer.save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def photo(clip_folder) -> Path:
    path = clip_folder.parent / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def test_a_model_from_an_hf_folder_carries_its_tokenizer_and_the_cli_explains_each_prompt(
    cli, clip_folder, photo, tokenizer, tmp_path
):
    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", f"hf:{clip_folder}",
        "--prompt", _TEXTS[0], "--prompt", _TEXTS[1],
    )  # fmt: skip

    assert status == 0, error
    loaded = camviz.load_model(f"hf:{clip_folder}")
    image = loaded.preprocess(camviz.load_image(photo)).unsqueeze(0)
    carried = camviz.explain(loaded.model, image, target=camviz.TextPrompt(_TEXTS[:2]))
    given = camviz.explain(tp.hf_clip(), image, target=camviz.TextPrompt(_TEXTS[:2], tokenizer))
    torch.testing.assert_close(carried.heatmaps, given.heatmaps)
    (row,) = rows(tmp_path / "out")
    assert [entry["score"] for entry in row["explained"]] == pytest.approx(
        carried.scores.tolist(), abs=1e-5
    )
    assert row["files"][:2] == ["photo_rank1_overlay.png", "photo_rank1_panel.jpg"]


def test_prompt_options_that_do_not_fit_are_one_line(cli, clip_folder, photo, tmp_path):
    bare = tmp_path / "clip-without-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        (bare / name).write_bytes((clip_folder / name).read_bytes())
    vit = tmp_path / "vit"
    tp.hf_vit().save_pretrained(vit)
    (vit / "preprocessor_config.json").write_bytes(
        (clip_folder / "preprocessor_config.json").read_bytes()
    )
    cases = [
        (clip_folder, ["--target", "3"], "--prompt and --target"),
        (bare, [], "tokenizer.save_pretrained(DIR)"),
        (vit, [], "CLIP-like model with a text tower"),
    ]
    for folder, options, fragment in cases:
        status, _, error = explain(
            cli, photo, tmp_path / "out", "--model", f"hf:{folder}", "--prompt", "a cat", *options
        )
        assert status == 1
        one_line_error(error, fragment)
    assert not (tmp_path / "out").exists()
