"""The demo's timeline PNG: drawn from synthetic metrics, n/a panels, clear errors for malformed input."""
import pytest

pytest.importorskip("matplotlib")

from mooncake_ep_switch.apps.timeline import plot_demo_timeline  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_metrics(num_steps=30):
    steps = []
    for i in range(num_steps):
        layout = "ep" if 10 <= i < 22 else "tp"
        steps.append({"step": i, "seconds": 0.02 + 0.001 * (i % 5) + (0.08 if i == 6 else 0.0),
                      "requests": 300 if layout == "ep" else 40 + i, "layout": layout,
                      "balancedness": None if i < 4 else (0.55 if i < 15 else 0.93)})
    events = [{"step": 6, "kind": "kill", "label": "rank 2 killed"},
              {"step": 8, "kind": "rejoin", "label": "rank 2 re-admitted"},
              {"step": 10, "kind": "switch", "label": "tp -> ep"},
              {"step": 15, "kind": "rebalance", "label": "EPLB commit"},
              {"step": 22, "kind": "switch", "label": "ep -> tp"},
              {"step": 25, "kind": "checkpoint", "label": "other kinds are grey"}]
    return {"steps": steps, "events": events}


def test_full_metrics_png(tmp_path):
    path = tmp_path / "timeline.png"
    assert plot_demo_timeline(synthetic_metrics(), str(path)) == str(path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 30_000  # four panels with lines and labels


def test_optional_keys_missing_and_unsorted_steps(tmp_path):
    # Only the required keys, steps out of order, no events key: the other panels say n/a.
    steps = [{"step": i, "seconds": 0.01 * (i + 1)} for i in (3, 0, 2, 1)]
    path = tmp_path / "minimal.png"
    plot_demo_timeline({"steps": steps}, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    # Some steps with, some without an optional key: drawn with gaps.
    steps = [{"step": 0, "seconds": 0.1, "layout": "tp"}, {"step": 1, "seconds": 0.1, "requests": 3},
             {"step": 2, "seconds": 0.1, "balancedness": 0.9, "layout": None}]
    plot_demo_timeline({"steps": steps, "events": []}, str(tmp_path / "partial.png"))
    assert (tmp_path / "partial.png").stat().st_size > 10_000


def test_group_size_gets_a_panel_of_its_own(tmp_path):
    # demo --resize writes the EP group's size per step: one more panel (a taller PNG), steps without it are gaps.
    def height(path):
        return int.from_bytes(path.read_bytes()[20:24], "big")  # the PNG's IHDR height

    metrics = synthetic_metrics(12)
    plot_demo_timeline(metrics, str(tmp_path / "without.png"))
    for i, step in enumerate(metrics["steps"]):
        if i != 3:
            step["group_size"] = 4 if i < 5 else 3 if i < 9 else 5
    plot_demo_timeline(metrics, str(tmp_path / "with.png"))
    assert height(tmp_path / "with.png") > height(tmp_path / "without.png")


@pytest.mark.parametrize("metrics, error, message", [
    ([], TypeError, "metrics must be a dict, got list"),
    ({}, ValueError, "metrics is missing the required key 'steps'"),
    ({"steps": {}}, TypeError, r"metrics\['steps'\] must be a list of dicts, got dict"),
    ({"steps": []}, ValueError, r"metrics\['steps'\] must hold at least one step"),
    ({"steps": [5]}, TypeError, r"metrics\['steps'\]\[0\] must be a dict, got int 5"),
    ({"steps": [{"step": 0, "seconds": 1.0}, {"step": 1}]}, ValueError,
     r"metrics\['steps'\]\[1\] is missing the required key 'seconds'"),
    ({"steps": [{"seconds": 1.0}]}, ValueError, r"metrics\['steps'\]\[0\] is missing the required key 'step'"),
    ({"steps": [{"step": 0, "seconds": "fast"}]}, TypeError,
     r"metrics\['steps'\]\[0\]\['seconds'\] must be a number, got str 'fast'"),
    ({"steps": [{"step": 0.5, "seconds": 1.0}]}, TypeError,
     r"metrics\['steps'\]\[0\]\['step'\] must be an integer, got float 0.5"),
    ({"steps": [{"step": 0, "seconds": float("nan")}]}, ValueError,
     r"metrics\['steps'\]\[0\]\['seconds'\] must be finite"),
    ({"steps": [{"step": 0, "seconds": 1.0, "layout": "dp"}]}, ValueError,
     r"metrics\['steps'\]\[0\]\['layout'\] must be 'ep' or 'tp' \(or absent\), got 'dp'"),
    ({"steps": [{"step": 0, "seconds": 1.0, "requests": 2.5}]}, TypeError,
     r"metrics\['steps'\]\[0\]\['requests'\] must be an integer"),
    ({"steps": [{"step": 0, "seconds": 1.0, "balancedness": "high"}]}, TypeError,
     r"metrics\['steps'\]\[0\]\['balancedness'\] must be a number"),
    ({"steps": [{"step": 0, "seconds": 1.0, "group_size": 4.5}]}, TypeError,
     r"metrics\['steps'\]\[0\]\['group_size'\] must be an integer, got float 4.5"),
    ({"steps": [{"step": 0, "seconds": 1.0}], "events": "kill"}, TypeError,
     r"metrics\['events'\] must be a list of dicts, got str"),
    ({"steps": [{"step": 0, "seconds": 1.0}], "events": [{"step": 0}]}, ValueError,
     r"metrics\['events'\]\[0\] is missing the required key 'kind'"),
    ({"steps": [{"step": 0, "seconds": 1.0}], "events": [{"step": 0, "kind": "kill", "label": 3}]}, TypeError,
     r"metrics\['events'\]\[0\]\['label'\] must be a str, got int 3"),
])
def test_malformed_input_names_the_key(tmp_path, metrics, error, message):
    path = tmp_path / "bad.png"
    with pytest.raises(error, match=message):
        plot_demo_timeline(metrics, str(path))
    assert not path.exists()
