// AgentRL dashboard: live refresh of a running run's page and the token view of a record. No libraries.
"use strict";

(function liveRefresh() {
  const main = document.querySelector("main[data-live]");
  if (!main) return;
  const every = 1000 * Number(main.dataset.live);
  async function refresh() {
    try {
      const response = await fetch(location.href, { headers: { "Accept": "text/html" } });
      if (response.ok) {
        const page = new DOMParser().parseFromString(await response.text(), "text/html");
        const fresh = page.querySelector("#live"), current = document.querySelector("#live");
        if (fresh && current) current.replaceWith(fresh);
        if (!page.querySelector("main[data-live]")) return;  // the run ended: stop polling
      }
    } catch (error) { /* the server is restarting: try again later */ }
    setTimeout(refresh, every);
  }
  setTimeout(refresh, every);
})();

(function tokenView() {
  const data = document.getElementById("token-data");
  if (!data) return;
  const views = JSON.parse(data.textContent);
  const info = document.getElementById("token-info");
  const legend = document.getElementById("token-legend");
  const containers = Array.from(document.querySelectorAll(".tokens[data-view]"));

  function shown(text, id) {
    if (text === null || text === undefined) return "⟨" + id + "⟩";
    return text.replace(/\n/g, "↵\n").replace(/\t/g, "→\t");
  }

  function escapeHtml(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  views.forEach(function (view) {
    view.shown = view.ids.map(function (id, i) { return escapeHtml(shown(view.texts ? view.texts[i] : null, id)); });
  });

  let hovered = null;

  const scales = {
    logprob: function (view, i) {
      if (!view.mask[i]) return null;
      return "rgba(239, 68, 68, " + (0.85 * Math.min(1, -view.logprobs[i] / 6)).toFixed(3) + ")";
    },
    mask: function (view, i) { return view.mask[i] ? "rgba(34, 197, 94, 0.35)" : null; },
    advantage: function (view, i) {
      if (!view.mask[i] || !view.advantages) return null;
      const a = view.advantages[i], alpha = (0.8 * Math.min(1, Math.abs(a) / view.maxAdvantage)).toFixed(3);
      return a >= 0 ? "rgba(34, 197, 94, " + alpha + ")" : "rgba(239, 68, 68, " + alpha + ")";
    },
    version: function (view, i) {
      const v = view.versions[i];
      return v < 0 ? null : "hsl(" + ((v * 67) % 360) + ", 75%, 82%)";
    },
    diff: function (view, i) {
      if (!view.mask[i] || !view.trainer_logprobs) return null;
      const d = Math.abs(view.trainer_logprobs[i] - view.logprobs[i]);
      return "rgba(147, 51, 234, " + (0.85 * Math.min(1, d / view.maxDiff)).toFixed(3) + ")";
    },
  };

  views.forEach(function (view) {
    let maxAdvantage = 0, maxDiff = 0;
    for (let i = 0; i < view.ids.length; i++) {
      if (!view.mask[i]) continue;
      if (view.advantages) maxAdvantage = Math.max(maxAdvantage, Math.abs(view.advantages[i]));
      if (view.trainer_logprobs) maxDiff = Math.max(maxDiff, Math.abs(view.trainer_logprobs[i] - view.logprobs[i]));
    }
    view.maxAdvantage = maxAdvantage || 1;
    view.maxDiff = maxDiff || 1e-6;
    view.rawMaxDiff = maxDiff;
  });

  function legendText(mode) {
    if (mode === "logprob") return "trained tokens: white = logprob 0, red = −6 or lower; grey text: not trained";
    if (mode === "mask") return "green: loss mask 1 (trained); grey: prompt, tool results, padding";
    if (mode === "advantage") {
      if (!views.some(function (v) { return v.advantages; })) return "no advantages: this trajectory was not made into a training sample";
      return "green: positive, red: negative advantage (full colour: ±" + Math.max.apply(null, views.map(function (v) { return v.maxAdvantage; })).toFixed(3) + ")";
    }
    if (mode === "version") {
      const seen = new Set();
      views.forEach(function (v) { v.versions.forEach(function (x) { if (x >= 0) seen.add(x); }); });
      return "policy version that sampled each token: " + (Array.from(seen).sort(function (a, b) { return a - b; }).map(function (v) { return "v" + v; }).join(", ") || "none known");
    }
    if (!views.some(function (v) { return v.trainer_logprobs; })) return "not known: the trainer has not trained this trajectory (or trained it with cross-entropy)";
    return "|trainer − engine| logprob; full purple: " + Math.max.apply(null, views.map(function (v) { return v.rawMaxDiff; })).toExponential(2) + " (the largest here)";
  }

  function paint(mode) {
    // one HTML string per view, set at once: much faster than styling 30,000 elements one by one
    containers.forEach(function (box) {
      const view = views[Number(box.dataset.view)], scale = scales[mode], starts = new Set(view.turn_starts);
      const parts = new Array(view.ids.length), pictures = {};
      (view.image_runs || []).forEach(function (run) { pictures[run.start] = run; });
      for (let i = 0; i < view.ids.length; i++) {
        const colour = scale(view, i);
        let style = colour ? "background: " + colour : "";
        if (!view.mask[i] && mode !== "version") style += (style ? "; " : "") + "color: #9ca3af";
        const picture = pictures[i];  // an image's tokens follow its picture
        parts[i] = (picture ? '<img class="token-image" src="' + escapeHtml(picture.url) + '" alt="image ' +
          escapeHtml(picture.sha256) + '" title="image ' + escapeHtml(picture.sha256.slice(0, 12)) + ": " +
          (picture.end - picture.start) + ' tokens">' : "") +
          '<span data-i="' + i + '"' + (starts.has(i) && i > 0 ? ' class="turn"' : "") +
          (style ? ' style="' + style + '"' : "") + ">" + view.shown[i] + "</span>";
      }
      box.innerHTML = parts.join("");
    });
    hovered = null;
    legend.textContent = " — " + legendText(mode);
  }

  function fmt(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(4); }

  containers.forEach(function (box) {
    box.addEventListener("mouseover", function (event) {
      const span = event.target.closest("span[data-i]");
      if (!span) return;
      if (hovered) hovered.classList.remove("hover");
      hovered = span;
      span.classList.add("hover");
      const view = views[Number(box.dataset.view)], i = Number(span.dataset.i);
      let turn = 0;
      view.turn_starts.forEach(function (start, index) { if (start <= i) turn = index; });
      const lines = [
        "token " + i + " of " + view.ids.length + " · id " + view.ids[i] + " · turn " + turn,
        "text " + JSON.stringify(view.texts ? view.texts[i] : null),
        "loss mask " + view.mask[i] + " · policy version " + (view.versions[i] < 0 ? "–" : view.versions[i]),
      ];
      if (view.mask[i]) {
        lines.push("engine logprob  " + fmt(view.logprobs[i]));
        if (view.trainer_logprobs) lines.push("trainer logprob " + fmt(view.trainer_logprobs[i]) + (view.trainer_version === null ? " (unpublished weights)" : " (v" + view.trainer_version + ")") + " · diff " + fmt(view.trainer_logprobs[i] - view.logprobs[i]));
        if (view.advantages) lines.push("advantage " + fmt(view.advantages[i]));
      }
      info.textContent = lines.join("\n");
    });
  });

  document.querySelectorAll("input[name=colour]").forEach(function (input) {
    input.addEventListener("change", function () { paint(input.value); });
  });
  // a link may choose the colouring: #colour=diff
  const chosen = /colour=(\w+)/.exec(location.hash);
  const radio = chosen && document.querySelector("input[name=colour][value=" + chosen[1] + "]");
  if (radio) radio.checked = true;
  paint(document.querySelector("input[name=colour]:checked").value);
  document.body.dataset.tokenViewMs = Math.round(performance.now());  // since navigation start (bench/dashboard.py)
})();
