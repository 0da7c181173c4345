"""The run report: one self-contained HTML page (inline CSS and JS, nothing fetched).

A Gantt timeline has one row per agent, in tree order, from its spawn to its settling
(or now), coloured by state; hovering a bar shows its task and its result or error.
Totals and the failures (with their errors) come first. The page is rendered on the
server side, so it shows without JS; the small script only filters rows.
"""

from __future__ import annotations

import datetime as dt
from html import escape

from swarm.report.display import Prices, fmt_cost, fmt_duration, fmt_tokens
from swarm.report.view import AgentView, SwarmView
from swarm.text import plural

#: Characters of a task, answer or error kept in a bar's hover text.
TIP_CHARS = 600
COLORS = {
    "done": "#2f9e5b", "failed": "#d64545", "timed_out": "#e07b39", "cancelled": "#8e6bbf",
    "refused": "#a33b3b", "running": "#e0a526", "parked": "#4f7fe0", "queued": "#9aa5b1",
    "waiting": "#b8c0c8",
}
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
          86400)

CSS = """
*{box-sizing:border-box}
body{margin:0;font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d232a;
 background:#f6f7f9}
header,section{padding:12px 20px}
h1{font-size:18px;margin:0 0 4px}h2{font-size:15px;margin:0 0 8px}
.task{color:#555;white-space:pre-wrap;max-height:5.6em;overflow:auto}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:16px}.card span{color:#666;font-size:12px}
.chip{display:inline-block;border-radius:10px;padding:1px 8px;margin:2px 4px 2px 0;color:#fff;
 font-size:12px;cursor:pointer;user-select:none}
.chip.off{opacity:.3}
.failures{background:#fff4f4;border-top:1px solid #f0caca;border-bottom:1px solid #f0caca}
.failures li{margin:4px 0}.failures pre{margin:2px 0 0;white-space:pre-wrap;color:#8a1f1f;
 max-height:8em;overflow:auto}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
#filter{padding:4px 8px;width:260px;border:1px solid #ccd;border-radius:4px;margin:0 12px 8px 0}
.gantt{background:#fff;border:1px solid #dde1e6;border-radius:6px}
.row{display:grid;grid-template-columns:minmax(220px,30%) 1fr 72px 64px;align-items:center;
 border-bottom:1px solid #f0f1f3;height:20px}
.row:hover{background:#f3f6fb}
.row.hidden{display:none}
.name{overflow:hidden;white-space:nowrap;text-overflow:ellipsis;padding-right:8px}
.name code{color:#2a5db0}
.track{position:relative;height:100%;background-image:linear-gradient(90deg,#eceef1 1px,
 transparent 1px);background-size:var(--tick) 100%}
.bar{position:absolute;top:4px;height:12px;border-radius:3px;min-width:2px}
.bar.open{background-image:repeating-linear-gradient(45deg,rgba(255,255,255,.35) 0 4px,
 transparent 4px 8px)}
.num{text-align:right;padding-right:8px;color:#555;font-variant-numeric:tabular-nums}
.axis{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid #ccd;height:22px;
 font-size:11px;color:#666}
.axis .track{background:none}
.tick{position:absolute;top:4px;transform:translateX(-50%);white-space:nowrap}
footer{padding:8px 20px 24px;color:#888;font-size:12px}
"""

JS = """
(function(){
  var rows=[].slice.call(document.querySelectorAll('.gantt .row[data-state]'));
  var off={};
  var input=document.getElementById('filter');
  function apply(){
    var q=(input.value||'').toLowerCase(), shown=0;
    rows.forEach(function(r){
      var hide=off[r.dataset.state]||(q&&r.dataset.q.indexOf(q)<0);
      r.classList.toggle('hidden',!!hide); if(!hide)shown++;
    });
    document.getElementById('shown').textContent=shown+' of '+rows.length+' agents shown';
  }
  input.addEventListener('input',apply);
  [].forEach.call(document.querySelectorAll('.chip[data-state]'),function(c){
    c.addEventListener('click',function(){
      var s=c.dataset.state; off[s]=!off[s]; c.classList.toggle('off',off[s]); apply();
    });
  });
  apply();
  document.body.setAttribute('data-ready',String(rows.length));
})();
"""


def _tick_step(span: float) -> float:
    return next((s for s in _STEPS if span / s <= 10), _STEPS[-1] * (1 + int(span // 864000)))


def _cut(text: str, n: int = TIP_CHARS) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _tip(agent: AgentView, now: float) -> str:
    lines = [f"{agent.id} ({agent.state}, depth {agent.depth}) "
             f"{fmt_duration(agent.elapsed(now))}, {plural(agent.turns, 'turn')}, "
             f"{fmt_tokens(agent.tokens)} tokens",
             "task: " + _cut(agent.task or agent.label)]
    if agent.error:
        lines.append("error: " + _cut(agent.error))
    if agent.landing:
        lines.append("its work: " + agent.landing)
    for _, text in agent.said:
        lines.append("told: " + _cut(text))
    if agent.answer:
        lines.append("result: " + _cut(agent.answer))
    elif agent.last and not agent.is_settled:
        lines.append("doing: " + _cut(agent.last))
    return "\n".join(lines)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def render_html(view: SwarmView, prices: Prices) -> str:
    """The report page of ``view`` as one HTML string."""
    now = view.taken
    start = min([view.created(), *(a.start() for a in view.agents if a.start())])
    end = max([view.end(), *(a.end(now) for a in view.agents)])
    span = max(end - start, 0.001)
    step = _tick_step(span)
    usage = view.usage()
    counts = view.counts()
    cost = view.cost(prices)
    title = f"swarm {view.swarm_id} — {view.state}"
    out: list[str] = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        '<meta name=viewport content="width=device-width,initial-scale=1">',
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<header><h1>{escape(title)}</h1>",
        f"<div class=task>{escape(view.info.get('task', ''))}</div>",
        f"<div>workspace <code>{escape(view.info.get('workspace', ''))}</code> · started "
        f"{_when(view.created())}</div></header>",
        "<section class=totals><div class=cards>",
        _card(str(len(view.agents)), "agents"),
        _card(fmt_duration(view.wall()), "wall time"),
        _card(fmt_tokens(usage.get("total_tokens", 0)),
              f"tokens ({fmt_tokens(usage.get('prompt_tokens', 0))} in, "
              f"{fmt_tokens(usage.get('completion_tokens', 0))} out)"),
    ]
    if cost is not None:
        out.append(_card("~" + fmt_cost(cost), "estimated cost"))
    out.append(_card(str(len(view.failures())), "failed"))
    out.append("</div><p>")
    order = list(COLORS)
    for state in sorted(counts, key=lambda s: (order.index(s) if s in order else 99, s)):
        out.append(f'<span class=chip data-state="{escape(state)}" title="click to hide or '
                   f'show" style="background:{COLORS.get(state, "#666")}">'
                   f"{counts[state]} {escape(state)}</span>")
    out.append("</p>")
    by_type = view.type_lines(prices)
    if by_type:
        out.append("<p>By agent type:</p><ul>"
                   + "".join(f"<li>{escape(line.strip())}</li>" for line in by_type) + "</ul>")
    out.append("</section>")
    failures = view.failures()
    if failures:
        out.append(f"<section class=failures><h2>Failures ({len(failures)})</h2><ol>")
        for agent in failures:
            error = _cut(agent.error or "(no error recorded)", 2000)
            out.append(
                f'<li><a href="#agent-{escape(agent.id)}"><code>{escape(agent.id)}</code></a> '
                f"<b>{escape(agent.state)}</b> after {fmt_duration(agent.elapsed(now))} — "
                f"{escape(agent.label)}<pre>{escape(error)}"
                "</pre></li>")
        out.append("</ol></section>")
    said = [(ts, agent, text) for agent in view.agents for ts, text in agent.said]
    if said:
        out.append(f"<section class=messages><h2>Messages sent to agents ({len(said)})</h2><ol>")
        for ts, agent, text in sorted(said, key=lambda m: m[0]):
            out.append(f'<li>{_when(ts)} to <a href="#agent-{escape(agent.id)}"><code>'
                       f"{escape(agent.id)}</code></a>: <q>{escape(_cut(text, 500))}</q></li>")
        out.append("</ol></section>")
    out.append("<section><h2>Timeline</h2>"
               '<input id=filter type=search placeholder="filter by id or task">'
               "<span id=shown></span>")
    out.append(f'<div class=gantt style="--tick:{step / span * 100:.4f}%">')
    out.append('<div class="row axis"><div class=name>agent</div><div class=track>')
    t = 0.0
    while t <= span + 1e-9:
        out.append(f'<span class=tick style="left:{t / span * 100:.3f}%">{fmt_duration(t)}</span>')
        t += step
    out.append("</div><div class=num>time</div><div class=num>tokens</div></div>")
    for agent in view.agents:
        left = (agent.start() - start) / span * 100 if agent.start() else 0.0
        width = max((agent.end(now) - (agent.start() or start)) / span * 100, 0.15)
        width = min(width, 100 - left)
        color = COLORS.get(agent.state, "#666")
        query = f"{agent.id} {agent.state} {agent.label}".lower()
        out.append(
            f'<div class=row id="agent-{escape(agent.id)}" data-state="{escape(agent.state)}" '
            f'data-q="{escape(query)}"><div class=name style="padding-left:'
            f'{4 + 14 * agent.level}px" title="{escape(agent.label)}"><code>{escape(agent.id)}'
            f"</code> {escape(agent.label)}</div><div class=track>"
            f'<div class="bar{"" if agent.is_settled else " open"}" style="left:{left:.3f}%;'
            f'width:{width:.3f}%;background-color:{color}" title="{escape(_tip(agent, now))}">'
            f"</div></div><div class=num>{fmt_duration(agent.elapsed(now))}</div>"
            f"<div class=num>{fmt_tokens(agent.tokens)}</div></div>")
    out.append("</div></section>")
    out.append(f"<footer>{escape(view.summary(prices))} · report written "
               f"{_when(now)}</footer>")
    out.append(f"<script>{JS}</script></body></html>")
    return "\n".join(out)


def _card(value: str, label: str) -> str:
    return f"<div class=card><b>{escape(value)}</b><span>{escape(label)}</span></div>"
