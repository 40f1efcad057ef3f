"""`flexrl make-workload | plan | simulate | bench planner` through flexrl_ds.cli.main.main."""

from __future__ import annotations

import json

from flexrl_ds.cli.main import main
from flexrl_ds.planning.plan import load_plan, load_workload, validate_plan
from flexrl_ds.planning.schedule import check_schedule


def test_make_workload_then_plan(tmp_path, capsys):
    workload_path, plan_path = tmp_path / "w.json", tmp_path / "plan.json"
    assert main(["make-workload", "--mix", "video-heavy", "--num", "96", "--seed", "2", "--n-samples", "4",
                 "--out", str(workload_path)]) == 0
    workload = load_workload(workload_path)
    assert len(workload.sequences) == 96
    assert main(["plan", "--workload", str(workload_path), "--world-size", "16", "--model", "qwen2.5-vl-7b",
                 "--p-max", "8", "--h-pack", "2048", "--H-pack", "8192", "--out", str(plan_path)]) == 0
    out = capsys.readouterr().out
    for word in ("attention balance", "cost balance", "token balance", "efficiency", "degrees", "packs",
                 "all-to-all", "deadlock-free", "bounds for any plan"):
        assert word in out
    raw = json.loads(plan_path.read_text())
    assert set(raw) >= {"world_size", "p_max", "packs", "rank_order"}
    assert set(raw["rank_order"]) == {str(r) for r in range(16)}
    assert raw["h_pack"] == 2048 and raw["H_pack"] == 8192
    plan = load_plan(plan_path)
    validate_plan(plan, workload)
    assert check_schedule(plan).deadlock_free


def test_plan_reads_the_config_and_reports_json(tmp_path, capsys):
    workload_path = tmp_path / "w.json"
    workload_path.write_text(json.dumps({"sequences": [{"id": "big", "tokens": 70000},
                                                       {"id": "a", "tokens": 500}, {"id": "b", "tokens": 700}]}))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3},
                                  "flexrl": {"sp": {"p_max": 4, "max_tokens_per_rank": 10000, "oversize": "drop"}}}))
    assert main(["plan", "--workload", str(workload_path), "--world-size", "8", "--config", str(config), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dropped"] == ["big"]
    assert main(["plan", "--workload", str(workload_path), "--world-size", "8", "--config", str(config),
                 "--oversize", "truncate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["truncated"] == {"big": 40000}


def test_a_cap_raised_on_the_command_line_over_the_configs_log_prob_cap(tmp_path, capsys):
    """The planning tools plan under the plain cap: a run config's looser log-prob cap neither
    applies nor stands in the way of a larger --max-tokens-per-rank."""
    workload_path = tmp_path / "w.json"
    workload_path.write_text(json.dumps({"sequences": [{"id": "a", "tokens": 6000}, {"id": "b", "tokens": 6000}]}))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"flexrl": {"sp": {"p_max": 4, "max_tokens_per_rank": 1000,
                                                    "logprob_max_tokens_per_rank": 4000}}}))
    base = ["plan", "--workload", str(workload_path), "--world-size", "4", "--config", str(config), "--json"]
    assert main(base + ["--max-tokens-per-rank", "8000"]) == 0
    assert json.loads(capsys.readouterr().out)["dropped"] == []
    assert main(base) == 2  # 12,000 tokens on 4 ranks under the plain cap of 1,000
    assert "max_tokens_per_rank=1000" in capsys.readouterr().err


def test_a_step_over_the_cap_is_planned_as_the_trainers_micro_batches(tmp_path, capsys):
    """Ten sequences of 1,000 tokens under a cap of 800 x 4 ranks: no one plan holds them; `flexrl
    plan` prints and writes the micro-batches `planning/micro_batches.py` cuts (each under the cap,
    every sequence in exactly one), the same plans the trainer would run."""
    from flexrl_ds.planning.config import SPConfig
    from flexrl_ds.planning.cost_model import load_cost_model
    from flexrl_ds.planning.micro_batches import plan_micro_batches

    sequences = [{"id": f"s{i}", "tokens": 1000} for i in range(10)]
    workload_path, out = tmp_path / "w.json", tmp_path / "plan.json"
    workload_path.write_text(json.dumps({"sequences": sequences}))
    args = ["plan", "--workload", str(workload_path), "--world-size", "4", "--model", "qwen2.5-vl-7b",
            "--p-max", "4", "--max-tokens-per-rank", "800"]
    assert main(args + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    expected = plan_micro_batches([load_workload(workload_path)], 4, load_cost_model("qwen2.5-vl-7b"),
                                  SPConfig(p_max=4, max_tokens_per_rank=800))
    assert len(expected) > 1
    assert f"10 sequences (10000 tokens) do not plan in one pass under max_tokens_per_rank 800 x 4 ranks: " \
           f"{len(expected)} micro-batches" in printed
    seen = []
    for index, (result,) in enumerate(expected):
        written = load_plan(tmp_path / f"plan_micro{index}.json")
        assert written.packs == result.plan.packs and f"micro-batch {index} of {len(expected)}:" in printed
        seen += [s for pack in written.packs for s in pack.sequences]
        held = [sum(1000 / p.degree for p in written.packs if rank in p.ranks) for rank in range(4)]
        assert max(held) <= 800
    assert sorted(seen) == sorted(s["id"] for s in sequences)
    assert not out.exists()
    assert main(args + ["--json"]) == 0
    summaries = json.loads(capsys.readouterr().out)["micro_batches"]
    assert [s["num_packs"] for s in summaries] == [len(r.plan.packs) for (r,) in expected]


def test_micro_batches_see_oversize_sequences_dropped_or_truncated_once(tmp_path, capsys):
    """A 9,000-token sequence over 1,000 x 4 ranks among six of 1,000: dropped (or cut to 4,000)
    before the pass is cut, so the cuts plan what is kept, and the drop is reported once."""
    sequences = [{"id": "big", "tokens": 9000}] + [{"id": f"s{i}", "tokens": 1000} for i in range(6)]
    workload_path = tmp_path / "w.json"
    workload_path.write_text(json.dumps({"sequences": sequences}))
    args = ["plan", "--workload", str(workload_path), "--world-size", "4", "--model", "qwen2.5-vl-7b",
            "--p-max", "4", "--max-tokens-per-rank", "1000", "--json"]
    assert main(args + ["--oversize", "drop"]) == 0
    summaries = json.loads(capsys.readouterr().out)["micro_batches"]
    assert len(summaries) == 2 and [s["dropped"] for s in summaries] == [["big"], []]
    assert main(args + ["--oversize", "truncate", "--out", str(tmp_path / "t.json")]) == 0
    summaries = json.loads(capsys.readouterr().out)["micro_batches"]
    assert summaries[0]["truncated"] == {"big": 4000} and len(summaries) == 3  # 4,000 alone, then 6 x 1,000
    planned = [s for i in range(3) for pack in load_plan(tmp_path / f"t_micro{i}.json").packs for s in pack.sequences]
    assert sorted(planned) == sorted(s["id"] for s in sequences)


def test_bad_input_exits_2_naming_the_culprit(tmp_path, capsys):
    workload_path = tmp_path / "w.json"
    workload_path.write_text(json.dumps({"sequences": [{"id": "x", "tokens": 10}, {"id": "x", "tokens": 20}]}))
    assert main(["plan", "--workload", str(workload_path), "--world-size", "8"]) == 2
    assert "'x'" in capsys.readouterr().err
    workload_path.write_text(json.dumps({"sequences": [{"id": "x", "tokens": 10}]}))
    assert main(["plan", "--workload", str(workload_path), "--world-size", "6"]) == 2
    assert "world_size 6" in capsys.readouterr().err
    assert main(["plan", "--workload", str(workload_path), "--world-size", "8", "--p-max", "3"]) == 2
    assert "p_max" in capsys.readouterr().err
    assert main(["make-workload", "--mix", "audio", "--num", "5", "--out", str(tmp_path / "a.json")]) == 2
    assert "--mix" in capsys.readouterr().err


def test_simulate_table_json_and_plot(tmp_path, capsys):
    png = tmp_path / "loads.png"
    assert main(["simulate", "--mix", "image-heavy", "--world-size", "8", "--gbs", "8", "--n-samples", "2",
                 "--seeds", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for method in ("bucketing (veRL)", "bucketing (LPT)", "SP=2", "SP=4", "SP=8", "FlexUlysses"):
        assert method in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--mix", "only-video", "--world-size", "4", "--gbs", "4", "--seeds", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "SP=8" not in result["methods"]  # larger than the world
    flex = result["methods"]["FlexUlysses"]
    assert flex["efficiency"] >= 0.97
    assert flex["attention_balance"] >= flex["attention_balance_bound"] - 1e-9
    assert flex["efficiency"] <= flex["efficiency_bound"] + 1e-9


def test_bench_planner_small_grid(capsys):
    assert main(["bench", "planner", "--json", "--repeats", "1", "--seeds", "1", "--counts", "64",
                 "--world-sizes", "8,16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["num_sequences"], r["world_size"]) for r in result["timing"]] == [(64, 8), (64, 16)]
    assert len(result["quality"]) == 3 * 2
    assert all(r["plan_ms"] > 0 for r in result["timing"])
