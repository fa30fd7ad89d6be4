"""HF Marian and BART against tformer's EncoderDecoder: random-initialised transformers models
(built from configs, nothing downloaded) converted in and out; logits equal to 1e-4, and beam
search token-identical to transformers' ``generate``."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tformer.generation.beam import beam_search  # noqa: E402
from tformer.interop.hf import save_hf  # noqa: E402
from tformer.interop.hf import load_hf
from tformer.models.seq2seq import EncoderDecoder  # noqa: E402

V = 48
COMMON = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=40,
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.15)


def marian():
    cfg = transformers.MarianConfig(**COMMON, activation_function="swish", scale_embedding=True,
                                    pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0,
                                    forced_eos_token_id=None)
    return transformers.MarianMTModel(cfg)


def bart():
    cfg = transformers.BartConfig(**COMMON, activation_function="gelu", pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                                  forced_bos_token_id=None)
    return transformers.BartForConditionalGeneration(cfg)


def hf_model(make, eos_boost=0.0):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # a non-zero logits bias, so its conversion is tested too
        model.final_logits_bias.normal_(0.0, 0.5)
        model.final_logits_bias[0, model.config.eos_token_id] += eos_boost  # EOS at varied steps
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.config._attn_implementation = "eager"
    return model


def batch(pad):
    torch.manual_seed(1)
    src = torch.randint(3, V - 1, (3, 9))
    mask = torch.ones_like(src)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    src = src.masked_fill(mask == 0, pad)
    tgt = torch.randint(3, V - 1, (3, 7))
    return src, mask, tgt


@pytest.mark.parametrize("make", [marian, bart])
def test_logits_equal_transformers_both_ways(tmp_path, one_thread, make):
    hf = hf_model(make)
    src, mask, tgt = batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert isinstance(ours, EncoderDecoder) and ours.config.name == hf.config.model_type
    with torch.no_grad():
        got = ours(src, tgt, src_mask=mask)[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # and back out: transformers loads what save_hf writes and computes the same logits
    save_hf(ours, tmp_path / "out")
    again = type(hf).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        out = again(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _strip(seq, eos):
    seq = seq.tolist()
    return seq[: seq.index(eos) + 1] if eos in seq else seq


# EOS boosts chosen so that each case ends some outputs with EOS (at different steps) and others
# at max_new_tokens: every rule (finishing, closing, the three early_stopping modes) is exercised.
@pytest.mark.parametrize("make,boost,penalty,early", [
    (marian, 2.0, 1.0, False), (marian, 2.0, 2.0, True), (marian, 1.0, 0.5, "never"),
    (bart, 4.0, 1.0, False), (bart, 2.5, 2.0, True), (bart, 2.5, 0.5, "never")])
def test_beam_search_token_identical_to_generate(tmp_path, one_thread, make, boost, penalty, early):
    hf = hf_model(make, boost)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    c = hf.config
    src, mask, _ = batch(c.pad_token_id)
    kw = dict(num_beams=4, length_penalty=penalty, early_stopping=early, max_new_tokens=12)
    with torch.no_grad():
        ref = hf.generate(input_ids=src, attention_mask=mask, do_sample=False, num_return_sequences=2,
                          no_repeat_ngram_size=0, repetition_penalty=1.0, min_length=0, **kw)
    got = beam_search(ours, src, mask, bos=c.decoder_start_token_id, eos=c.eos_token_id, n_best=2, **kw)
    want = [_strip(row[1:], c.eos_token_id) for row in ref]
    assert any(seq[-1] == c.eos_token_id for seq in want)                  # the test is not vacuous
    assert [h.tokens for hyps in got for h in hyps] == want


@pytest.mark.parametrize("make", [marian, bart])
@pytest.mark.parametrize("beams", [1, 4])
def test_forced_eos_equals_generate(tmp_path, one_thread, make, beams):
    """HF's forced_eos_token_id (Marian's and BART's default): the token at max_new_tokens is EOS.
    A weak EOS boost lets most outputs reach the limit, where the forcing decides the last token."""
    hf = hf_model(make, 0.5)
    hf.config.forced_eos_token_id = hf.config.eos_token_id
    hf.generation_config.forced_eos_token_id = hf.config.eos_token_id
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    c = hf.config
    src, mask, _ = batch(c.pad_token_id)
    kw = dict(num_beams=beams, max_new_tokens=6)
    with torch.no_grad():
        ref = hf.generate(input_ids=src, attention_mask=mask, do_sample=False, no_repeat_ngram_size=0,
                          repetition_penalty=1.0, min_length=0, length_penalty=1.0, early_stopping=False, **kw)
    want = [_strip(row[1:], c.eos_token_id) for row in ref]
    assert all(seq[-1] == c.eos_token_id for seq in want) and any(len(seq) == 6 for seq in want)
    if beams == 1:
        from tformer.generation.beam import greedy
        got = greedy(ours, src, mask, bos=c.decoder_start_token_id, eos=c.eos_token_id, max_new_tokens=6,
                     forced_eos=c.eos_token_id)
    else:
        hyps = beam_search(ours, src, mask, bos=c.decoder_start_token_id, eos=c.eos_token_id, length_penalty=1.0,
                           forced_eos=c.eos_token_id, **kw)
        got = [h[0].tokens for h in hyps]
    assert got == want
    unforced = beam_search(ours, src, mask, bos=c.decoder_start_token_id, eos=c.eos_token_id, **kw)
    assert [h[0].tokens for h in unforced] != want                           # the forcing is what makes them equal


@pytest.mark.parametrize("make", [marian, bart])
def test_different_encoder_and_decoder_widths(tmp_path, one_thread, make, monkeypatch):
    """encoder_ffn_dim != decoder_ffn_dim (distilled models): logits equal to transformers' (1e-4)
    both ways, and the widths survive the round trip."""
    monkeypatch.setitem(COMMON, "encoder_ffn_dim", 48)
    monkeypatch.setitem(COMMON, "decoder_ffn_dim", 80)
    hf = hf_model(make)
    src, mask, tgt = batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert (ours.config.encoder_d_ff, ours.config.d_ff) == (48, 80)
    assert ours.encoder.blocks[0].ffn.up.out_features == 48 and ours.decoder.blocks[0].ffn.up.out_features == 80
    with torch.no_grad():
        torch.testing.assert_close(ours(src, tgt, src_mask=mask)[0], ref, atol=1e-4, rtol=1e-4)
    save_hf(ours, tmp_path / "out")
    again = type(hf).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert (again.config.encoder_ffn_dim, again.config.decoder_ffn_dim) == (48, 80)
    with torch.no_grad():
        out = again(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
