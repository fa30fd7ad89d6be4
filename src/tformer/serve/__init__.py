"""`tformer serve`: OpenAI's HTTP API with continuous batching, and the playground.

    schemas.py     request validation, response objects, error bodies (OpenAI's wire format)
    pool.py        the preallocated pool of per-sequence inference states; batched prefill and decode calls
    prefix_cache.py  KV blocks of shared prompt prefixes (system prompts, chat history), reused at admission
    scheduler.py   the thread that owns the model: admission, batched prefill and decode, finishing
    sampling.py    each row's token choice (greedy, sampled, logprobs) for a whole batch at once
    grammar.py     structured output: a JSON-schema constraint per sequence, masking its logits row
    server.py      what the routes share: model, tokenizer, limits, metrics; request -> sequences
    openai_api.py  /v1/completions, /v1/chat/completions, /v1/embeddings (JSON and SSE)
    tools.py       tool calls: the functions shown to the model, a call's schema for tool_choice, answers parsed
    tool_calls.py  an answer's tool calls read as it streams (OpenAI's deltas)
    inspect.py     attention and input x gradient attribution of one prediction (the playground)
    app.py         the Starlette app: routes, health, metrics, models, error handlers
    metrics.py     Prometheus text-format counters, gauges and histograms
    playground/    the page, its script and stylesheet (served by the app; no CDN)
"""
