"""The CTranslate2 path's text cleaning in Python is the graph's (`search.clean_texts`): the two
engines must read the same characters, or their strings and scores part."""

from __future__ import annotations

from keras_transformer.decoding.batch_decoder import clean_lines
from keras_transformer.serving.ctranslate2_translation import (
    _clean,
    translate_batch_with_ctranslate2,
)

AWKWARD = [
    "  Ein Hund  läuft.  ", "tab\there", "line\nbreak\r\nand\x00nul", "\u00a0no-break\u2003em",
    "\u2028line\u2029paragraph", "zero\u200bwidth", "\x7fdelete\x85next", "", "   ",
    "emoji 🐕 und Umlaute äöü", "a\u3000ideographic space",
]


def test_the_python_cleaning_is_the_graph_cleaning():
    assert [_clean(text) for text in AWKWARD] == clean_lines(AWKWARD)
    broken = [b"caf\xc3", b"\xff\xfeinvalid", b"ok"]
    assert [_clean(raw) for raw in broken] == clean_lines(broken)


def test_options_are_refused_as_our_engine_refuses_them():
    from keras_transformer.decoding.translator import decoding_options

    cases = [dict(beam_size=2, num_hypotheses=3), dict(beam_size=4, sampling_topk=10),
             dict(beam_size=1, sampling_topp=1.5)]
    for case in cases:
        ours = theirs = None
        try:
            decoding_options(["a"], **{**_DEFAULTS, **case})
        except ValueError as error:
            ours = str(error)
        try:  # refused before the translator is used
            translate_batch_with_ctranslate2(None, None, ["a"], **case)
        except ValueError as error:
            theirs = str(error)
        assert ours is not None and ours == theirs, case


_DEFAULTS = dict(beam_size=4, alpha=0.6, num_hypotheses=1, sampling_topk=1, sampling_topp=1.0,
                 sampling_temperature=1.0, seed=0, target_prefix=None,
                 return_token_scores=False, return_alignment=False, return_attention=False,
                 alignment_layer=-1, max_input_tokens=256, max_output_tokens=None,
                 extra_length=50, batch_size=32, batch_tokens=1, jit_compile=False)
