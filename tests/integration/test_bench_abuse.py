"""``binbatch bench memory`` and ``binbatch bench liar``, small, end to end: the embedded
engine and the sidecars as child processes on 127.0.0.1.  The tests hold each bench to
what it counts -- every post one answer and which, the sidecar alive, the liar's hints
distrusted and ignored -- not to its memory or latency figures (those belong in the
benchmarks, not in tests)."""

from __future__ import annotations

import json

from bench_support import run_binbatch

from binbatch_sidecar.core.hint_trust import MIN_SAMPLES

BENCH_TIMEOUT = 300


async def test_memory_bench_answers_every_post_once_and_the_sidecar_lives(tmp_path):
    code, out, err = await run_binbatch(tmp_path, "bench", "memory", "--quick", "--json", timeout=BENCH_TIMEOUT)
    assert code == 0, err.decode()[-3000:]
    assert b"[bench memory]" in err, "progress goes to stderr"
    doc = json.loads(out)
    assert doc["unanswered"] == 0 and doc["all_alive"]
    assert doc["stated_memory"] == "768Mi" and doc["stated_memory_bytes"] == 768 * 1024 * 1024
    mixed, lowered = doc["runs"]
    for run in (mixed, lowered):
        answers = run["answers"]
        assert sum(answers.values()) == run["posts"] == 12  # one answer each
        assert answers["none"] == answers["other"] == 0
        assert run["alive_at_end"] and run["answer_after"] == "200" and run["exit_code"] == 0
        assert run["rss_samples"] > 0 and run["rss_peak_bytes"] >= run["rss_before_bytes"] > 0
    assert mixed["kinds"] == {"under": 6, "over": 3, "over-chunked": 3}
    assert mixed["answers_by_kind"]["over"] == {"413": 3}  # refused by its Content-Length, never read
    assert set(mixed["answers_by_kind"]["over-chunked"]) <= {"413", "429"}  # read to the limit, or no room to
    assert set(mixed["answers_by_kind"]["under"]) <= {"200", "429"} and mixed["answers"]["200"] >= 1
    # four ~256 KiB bodies fill the lowered 1 MiB: the rest of the twelve sent at once are refused
    assert lowered["kinds"] == {"under": 12} and lowered["answers"]["429"] >= 1 and lowered["answers"]["200"] >= 1


async def test_liar_bench_serves_everyone_and_distrusts_only_the_liar(tmp_path):
    code, out, err = await run_binbatch(tmp_path, "bench", "liar", "--quick", "--json", timeout=BENCH_TIMEOUT)
    assert code == 0, err.decode()[-3000:]
    assert b"[bench liar]" in err, "progress goes to stderr"
    doc = json.loads(out)
    setup = doc["setup"]
    assert doc["failures"] == 0 and doc["answered"] == doc["sent"] == 2 * setup["requests"]
    liars, honest = setup["liar_requests"], setup["requests"] - setup["liar_requests"]
    for key in ("without", "with"):
        assert doc["pooled"][key]["liar"]["n"] == liars and doc["pooled"][key]["honest"]["n"] == honest
    # lying, its hints are distrusted after the evidence hint trust needs, and later ones ignored
    assert doc["distrusted_after"] == [MIN_SAMPLES] and doc["distrusted_at_end"] == [True]
    assert 1 <= doc["hints_ignored"][0] <= liars - MIN_SAMPLES
    assert doc["hints_ignored_without"] == [0.0]  # sending no hint, nothing of it is ignored; honest hints never are
    assert set(doc["ratios"]["honest"]) == {"e2e_mean", "e2e_p50", "e2e_p99"}
    assert doc["ratios"]["honest"]["e2e_p99"] > 0 and doc["target_honest_p99"] == 1.1
    assert len(doc["honest_p99_ratio_by_repeat"]) == setup["repeats"] == 1
    assert doc["distrusted_at_s"][0] > 0  # when the liar's eighth hinted answer ended
    assert set(doc["preemptions"]) == {"without", "with"}  # the engine's counter, around each run
