"""Generation: the prefill / decode-step pair (``step``), token choice (``sampling``), ``generate``
(ids), ``text`` (strings, stop strings, streaming) and ``beam`` (encoder-decoders)."""
