"""Generation: the prefill / decode-step pair (``step``), token choice (``sampling``), ``generate``
(ids), ``text`` (strings, stop strings, streaming), ``speculative`` (drafts verified k at a time) and
``beam`` (encoder-decoders)."""
