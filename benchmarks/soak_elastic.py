"""Soak of elastic resize: N consecutive trials of tests/test_elastic.py's scenario.

Each trial: two of torchrun's elastic agents ("nodes" of 2 ranks; tests/elastic_run.py) train a dp 4 job with --min-dp 2; the second
agent and its workers are SIGKILLed once step 10 is recorded (the job goes on at dp 2), then the
agent starts again (the job grows back to dp 4; tests/elastic_run.py holds the dp 2 workers
meanwhile). A trial passes when both agents exit 0, every
record of every step (steps recomputed after a restart included) matches the uninterrupted dp 4
run within 1e-3 (loss, absolute) and 1e-3 (grad norm, relative), and the run went 4 -> 2 -> 4.
Prints one line per trial with the transition times and a summary; exits 1 when any failed.

    PYTHONPATH=src python benchmarks/soak_elastic.py --trials 5
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from elastic_run import ARGS, STEPS, Trial, last_per_step, run_trial  # noqa: E402
from helpers import run_train  # noqa: E402
from tolerances import LOSS_ABS, NORM_REL  # noqa: E402


def problems(trial: Trial, ref: dict[int, dict]) -> list[str]:
    """What is wrong with a trial against the uninterrupted run's records ``ref`` ({step: record})."""
    out = [] if trial.codes == [0, 0] and "error" not in trial.seconds else \
        [f"agents exited {trial.codes}: {trial.seconds.get('error', '')}"]
    done = last_per_step(trial.records)
    if sorted(done) != list(range(1, STEPS + 1)):
        out.append(f"steps recorded: {sorted(done)[:3]}...{sorted(done)[-3:]}")
    worst = (0.0, 0.0)
    for r in (r for r in trial.records if r["event"] == "step"):
        want = ref[r["step"]]
        dl = abs(r["loss"] - want["loss"])
        dg = abs(r["grad_norm"] - want["grad_norm"]) / want["grad_norm"]
        worst = (max(worst[0], dl), max(worst[1], dg))
    if worst[0] > LOSS_ABS or worst[1] > NORM_REL:
        out.append(f"largest difference: loss {worst[0]:.2e}, grad norm {worst[1]:.2e} (relative)")
    worlds = [done[s]["world_size"] for s in sorted(done)]
    phases = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    if phases != [4, 2, 4]:
        out.append(f"world sizes went {phases}, not [4, 2, 4]")
    trial.seconds["worst_loss_diff"] = worst[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="soak-elastic-"))
    proc, ref = run_train([*ARGS, "--dp", "4"], root, name="ref", timeout=600)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return 1
    ref_at = last_per_step(ref)
    passed, t0 = 0, time.perf_counter()
    for i in range(args.trials):
        tmp = root / f"t{i}"
        tmp.mkdir()
        trial = run_trial(tmp, kill_after=10, deadline_s=300)
        wrong = problems(trial, ref_at)
        passed += not wrong
        s = trial.seconds
        print(f"trial {i + 1}: {'pass' if not wrong else 'FAIL'}; start {s.get('start', 0):.1f} s, "
              f"shrink {s.get('shrink', 0):.1f} s, grow {s.get('grow', 0):.1f} s, total "
              f"{s.get('total', 0):.1f} s; steps at dp 2: {trial.steps_at.get(2)}; largest loss "
              f"difference {s['worst_loss_diff']:.1e}" + "".join(f"\n  {w}" for w in wrong),
              flush=True)
        if wrong:
            print(trial.errors[-3000:])
    print(f"{passed} of {args.trials} trials passed in {time.perf_counter() - t0:.0f} s ({root})")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    raise SystemExit(main())
