"""The stress benchmark's report: stress.md and the headline figures."""

from __future__ import annotations

import math

def headline(res: dict, where: str = "smollm2-cpu") -> dict[str, float]:
    p = f"stress.{where}.{res['format']}."
    o = res["outputs"]
    hp = res.get("hostile_prompts", {})
    h = {p + "requests": res["requests"], p + "failed": len(res["failed"]), p + "mismatched": o["different"],
         p + "identical": o["identical"], p + "within_tolerance": o["within_tolerance"],
         p + "preemptions": res["preemptions"], p + "nonfinite": res["nonfinite_choices"],
         p + "disconnects": res["disconnects"],
         p + "disconnects_freed": sum(d["freed"] for d in res["disconnect_probes"])}
    if "same_tokens" in res:
        h[p + "same_tokens"] = res["same_tokens"]
    if math.isfinite(res["max_abs_dlogprob_first_token"]):  # inf: a first token differed
        h[p + "first_token_max_abs_dlogprob"] = res["max_abs_dlogprob_first_token"]
    if hp:
        h[p + "hostile_prompts_served"] = sum(v == "served" for k, v in hp.items() if k != "served after them")
    if "sigterm" in res:
        s = res["sigterm"]
        h[p + "sigterm_exit_s"] = s["exit_s"]
        h[p + "sigterm_left_behind"] = s["left_behind"]
        h[p + "sigterm_hung"] = float(bool(s.get("hung")))
        h[p + "restart_matches"] = float(s["probe_after_restart"] in ("identical", "within_tolerance"))
    return h


def _parallel_table(fmt: str, mode: str, command: str, rep: dict) -> list[str]:
    lines = ["", f"vLLM's parallel engine, {fmt}, {mode} (`{command}`): greedy outputs of 3 prompts "
             "(300 / 1100 / 2100 tokens) vs one process", "",
             "| configuration | ran | vs one process | note |", "|---|---|---|---|"]
    for cfg, r in rep.items():
        det = "".join(f" (first token {x['first_token_dlogprob']:.1e}, same tokens {x['same_tokens_until']}/{x['tokens']})"
                      if x.get("first_token_dlogprob") is not None else " (first token differs)"
                      for x in r.get("detail", []))
        lines.append(f"| {cfg} | {'yes' if r['ran'] else 'no'} | {', '.join(r['verdicts']) if r['ran'] else '-'}{det} | "
                     f"{('threads ' + str(r['bind']) + ', ' + str(r['seconds']) + ' s') if r['ran'] else r['error']} |")
    return lines


def markdown(run: dict) -> str:
    fmts = list(run["formats"])
    R = run["formats"]
    rec = run["record"]
    rows = [
        ("requests (in flight at most)", lambda r: f"{r['requests']} ({r['concurrency']})"),
        ("prompt tokens min / max / total", lambda r: "{min} / {max} / {total}".format(**r["prompt_tokens"])),
        ("KV space", lambda r: f"{r['kv_pages']} pages = {r['kv_tokens']} tokens"),
        ("peak running / waiting / KV usage",
         lambda r: f"{r['peak']['running']:.0f} / {r['peak']['waiting']:.0f} / {r['peak']['kv_usage']:.2f}"),
        ("preemptions (vLLM's counter)", lambda r: f"{r['preemptions']:.0f}"),
        ("prefix cache hit rate", lambda r: f"{r['prefix_cache_hit_rate']}"),
        ("failed requests", lambda r: f"{len(r['failed'])}"),
        ("non-finite logprobs (choices)", lambda r: f"{r['nonfinite_choices']}"),
        ("greedy outputs vs alone: identical / within tolerance / different",
         lambda r: "{identical} / {within_tolerance} / {different}".format(**r["outputs"])),
        ("greedy outputs with the same tokens as alone", lambda r: f"{r.get('same_tokens', '-')}"),
        ("max \\|d logprob\\| first token / all tokens both chose",
         lambda r: f"{r['max_abs_dlogprob_first_token']:.1e} / {r['max_abs_dlogprob_same_tokens']:.1e}"),
        ("client disconnects under load", lambda r: f"{r['disconnects']}"),
        ("KV usage after the load drained", lambda r: f"{r['kv_usage_after_load']:.3f}"),
        ("disconnect probes: pages all freed",
         lambda r: f"{sum(d['freed'] for d in r['disconnect_probes'])} of {len(r['disconnect_probes'])}"),
        ("hostile prompts (over max-model-len, id = vocab, negative id, empty): refused with",
         lambda r: ", ".join(f"{v}" for k, v in r.get("hostile_prompts", {}).items() if k != "served after them")
         + f"; served after them: {r.get('hostile_prompts', {}).get('served after them', '-')}"),
        ("server RSS MiB before / after load / at the end",
         lambda r: f"{r['rss_mib_before']} / {r['rss_mib_after_load']} / {r['rss_mib_after']}"),
        ("load wall time / solo replay", lambda r: f"{r['load_wall_s']} s / {r['solo_wall_s']} s"),
        ("SIGTERM with requests in flight (--shutdown-timeout): exit code, seconds",
         lambda r: (f"({r['sigterm'].get('shutdown_timeout', 0)} s) "
                    + (f"hung: {', '.join(r['sigterm']['hung']['alive'])} still running after {r['sigterm']['exit_s']} s, "
                       "killed" if r['sigterm'].get('hung') else f"{r['sigterm']['exit_code']}, {r['sigterm']['exit_s']}"))
         if "sigterm" in r else "-"),
        ("processes left behind",
         lambda r: f"{r['sigterm']['left_behind']} of {r['sigterm']['processes']}" if "sigterm" in r else "-"),
        ("in-flight completed / errors seen",
         lambda r: (f"{r['sigterm']['inflight_completed']} of {r['sigterm']['inflight']} / "
                    f"{', '.join(r['sigterm']['inflight_errors']) or '-'}") if "sigterm" in r else "-"),
        ("restart: seconds, probe vs before",
         lambda r: f"{r['sigterm']['restart_s']}, {r['sigterm']['probe_after_restart']}" if "sigterm" in r else "-"),
    ]
    lines = ["# Stress: formats under load and faults", "", f"`{rec['command']}`", "",
             f"{rec['machine']['cpu']} ({rec['machine']['cpu_count']} CPUs), {rec['time']}"]
    if fmts:
        r0 = R[fmts[0]]
        lines[-1] += f", model dtype {r0['dtype']}; request kinds: {', '.join(f'{k} {v}' for k, v in r0['kinds'].items())}"
        lines += ["", "| figure | " + " | ".join(fmts) + " |", "|---|" + "---|" * len(fmts)]
        lines += [f"| {name} | " + " | ".join(f(R[x]) for x in fmts) + " |" for name, f in rows]
    for section, mode in (("parallel", "compiled"), ("parallel-eager", "--enforce-eager")):
        for fmt, rep in run.get(section, {}).items():
            if fmt not in ("record", "commands"):
                cmd = run[section].get("commands", {}).get(fmt, run[section]["record"]["command"])
                lines += _parallel_table(fmt, mode, cmd, rep)
    if "sigterm_trials" in run:
        t = run["sigterm_trials"]
        lines += ["", f"SIGTERM with 8 requests in flight, each time a fresh server (`{t['record']['command']}`)", "",
                  "| format | trials | exited (code 0) | hung, killed | exit seconds | processes left behind | "
                  "in-flight completed |", "|---|---|---|---|---|---|---|"]
        for fmt, ts in t.items():
            if fmt == "record":
                continue
            lines.append(f"| {fmt} | {len(ts)} | {sum(x['exit_code'] == 0 for x in ts)} | {sum(bool(x['hung']) for x in ts)} | "
                         f"{', '.join(str(x['exit_s']) for x in ts)} | {sum(x['left_behind'] for x in ts)} | "
                         f"{sum(x['inflight_completed'] for x in ts)} of {sum(x['inflight'] for x in ts)} |")
    for x in fmts:
        if R[x]["failed"]:
            lines += ["", f"Failures ({x}):", ""] + [f"- #{f['idx']} {f['kind']}: {f['error']}" for f in R[x]["failed"][:20]]
    return "\n".join(lines) + "\n"
