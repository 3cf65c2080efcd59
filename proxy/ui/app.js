// The status page: reads GET /events (server-sent events, through fetch so that it can send
// the API key) and keeps the models, the activity, the charts and the logs up to date.
// Everything from the server is shown as text (textContent, text nodes), never as markup.
'use strict';

(() => {
  const KEY_STORE = 'blazar-proxy.key';
  const LOG_CAP = 1000;
  const SERIES_WINDOW_S = 900;
  // Keepalives come every 15 s: a stream silent for this long is dead, and is reopened.
  const STALL_MS = 45000;
  const SVG_NS = 'http://www.w3.org/2000/svg';

  const $ = (id) => document.getElementById(id);

  const ui = {
    conn: $('conn'), version: $('version'), draining: $('draining'),
    keySection: $('key-section'), keyForm: $('key-form'), keyInput: $('key-input'), keyMessage: $('key-message'),
    modelsBody: $('models-body'), modelsMessage: $('models-message'), modelsEmpty: $('models-empty'),
    charts: $('charts'),
    activityBody: $('activity-body'), activityMessage: $('activity-message'), activityEmpty: $('activity-empty'),
    activityFilter: $('activity-filter'),
    logChild: $('log-child'), logs: $('logs'), logNote: $('log-note'), logsEmpty: $('logs-empty'),
  };

  const state = {
    key: sessionStorage.getItem(KEY_STORE) || '',
    skew: 0,                 // gateway clock - this clock, in seconds
    activityLimit: 300,
    stepS: 10,
    models: new Map(),       // id -> {view, at, row, cells, buttons}
    activity: new Map(),     // id -> {data, row, cancel}
    inFlight: new Set(),     // activity ids whose duration counts up
    series: [],
    logs: new Map(),         // child -> {lines, pre, option, stick}
    childModel: new Map(),   // child -> model id
    busy: new Set(),         // "action:id" of the admin calls running
    filter: '',
  };

  // ---- small helpers

  // An element with attributes and children; strings become text nodes.
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null || v === false) continue;
      if (k === 'class') el.className = v;
      else el.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children) if (c != null && c !== '') el.append(c);
    return el;
  }

  function svg(tag, attrs) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    return el;
  }

  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }

  const nowS = () => Date.now() / 1000;
  const serverNow = () => nowS() + state.skew;
  const pad = (n) => String(n).padStart(2, '0');
  const DASH = '—';

  function fmtClock(t) {
    const d = new Date(t * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function fmtSpan(s) {
    s = Math.max(0, Math.floor(s));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
    return `${Math.floor(s / 3600)}h ${pad(Math.floor(s / 60) % 60)}m`;
  }

  function fmtMs(ms) {
    if (ms == null) return DASH;
    if (ms < 1000) return `${Math.round(ms)} ms`;
    return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
  }

  function fmtBytes(n) {
    if (n == null) return DASH;
    if (n < 1000) return `${n} B`;
    const units = ['kB', 'MB', 'GB', 'TB'];
    let i = -1;
    do { n /= 1000; i++; } while (n >= 1000 && i < units.length - 1);
    return `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
  }

  function fmtNum(v, digits = 1) {
    if (v == null) return DASH;
    return Math.abs(v) >= 100 ? String(Math.round(v)) : String(+v.toFixed(digits));
  }

  function setMessage(el, text, isError) {
    el.textContent = text;
    el.dataset.kind = isError ? 'error' : 'info';
  }

  // Engines may colour their output; the escape sequences are noise in the page.
  const ANSI = /\x1b\[[0-9;?]*[A-Za-z]/g;

  // ---- connection

  let controller = null;
  let retryTimer = 0;

  function setConn(kind, text) {
    ui.conn.dataset.conn = kind;
    setText(ui.conn, text);
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra);
    if (state.key) headers.Authorization = `Bearer ${state.key}`;
    return headers;
  }

  async function connect() {
    clearTimeout(retryTimer);
    if (controller) controller.abort();
    const ctl = controller = new AbortController();
    let stall = 0;
    const alive = () => { clearTimeout(stall); stall = setTimeout(() => ctl.abort(), STALL_MS); };
    try {
      alive();
      const res = await fetch('/events', {
        headers: authHeaders({ Accept: 'text/event-stream' }), cache: 'no-store', signal: ctl.signal,
      });
      if (res.status === 401) {
        clearTimeout(stall);
        needKey(state.key ? 'That API key was refused. Enter it again.' : '');
        return;
      }
      if (!res.ok || !res.body) throw new Error(`HTTP ${res.status}`);
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      const feed = sseParser(dispatch);
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        alive();
        feed(decoder.decode(value, { stream: true }));
      }
    } catch (err) {
      if (ctl !== controller) return;   // replaced by a newer connection
    } finally {
      clearTimeout(stall);
    }
    if (ctl !== controller) return;
    setConn('reconnecting', 'reconnecting…');
    retryTimer = setTimeout(connect, 1000 + Math.random() * 1000);
  }

  // SSE: "event:" and "data:" lines, a blank line ends an event, ":" lines are comments.
  function sseParser(onEvent) {
    let buf = '';
    let carry = '';
    let name = '';
    let data = [];
    const line = (l) => {
      if (l === '') {
        if (data.length) onEvent(name || 'message', data.join('\n'));
        name = '';
        data = [];
        return;
      }
      if (l[0] === ':') return;
      const c = l.indexOf(':');
      const field = c < 0 ? l : l.slice(0, c);
      let value = c < 0 ? '' : l.slice(c + 1);
      if (value[0] === ' ') value = value.slice(1);
      if (field === 'event') name = value;
      else if (field === 'data') data.push(value);
    };
    return (chunk) => {
      let text = carry + chunk;
      carry = '';
      if (text.includes('\r')) {
        // A "\r" at the end may be the first half of "\r\n".
        if (text.endsWith('\r')) { carry = '\r'; text = text.slice(0, -1); }
        text = text.replace(/\r\n?/g, '\n');
      }
      const from = buf.length;
      buf += text;
      let start = 0;
      let nl;
      while ((nl = buf.indexOf('\n', Math.max(start, from))) !== -1) {
        line(buf.slice(start, nl));
        start = nl + 1;
      }
      buf = buf.slice(start);
    };
  }

  const handlers = {
    snapshot: onSnapshot,
    model: (v) => { putModel(v); updateLogNote(); toggleEmpty(); },
    model_removed: (d) => { removeModel(d.id); toggleEmpty(); },
    activity: (d) => { putActivity(d.rows || []); toggleEmpty(); },
    series: onSeries,
    log: (d) => appendLog(d.child, d.lines || []),
    gateway: onGateway,
  };

  function dispatch(name, raw) {
    const handler = handlers[name];
    if (!handler) return;
    try {
      handler(JSON.parse(raw));
    } catch (err) {
      console.error(`status page: bad "${name}" event`, err);
    }
  }

  // ---- API key

  function needKey(message) {
    state.key = '';
    sessionStorage.removeItem(KEY_STORE);
    if (controller) { controller.abort(); controller = null; }
    clearTimeout(retryTimer);
    setConn('needs-key', 'needs key');
    ui.keySection.hidden = false;
    setMessage(ui.keyMessage, message, !!message);
    ui.keyInput.focus();
  }

  ui.keyForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const key = ui.keyInput.value.trim();
    if (!key) return;
    state.key = key;
    sessionStorage.setItem(KEY_STORE, key);
    ui.keyInput.value = '';
    ui.keySection.hidden = true;
    setMessage(ui.keyMessage, '', false);
    setConn('connecting', 'connecting…');
    connect();
  });

  // POST an admin action; the error envelope's message becomes the thrown error's.
  async function post(path) {
    const res = await fetch(path, { method: 'POST', headers: authHeaders(), cache: 'no-store' });
    let body = null;
    try { body = await res.json(); } catch (err) { body = null; }
    if (res.status === 401) {
      needKey('The API key was refused. Enter it again.');
      throw new Error('the API key was refused');
    }
    if (!res.ok) throw new Error((body && body.error && body.error.message) || `HTTP ${res.status}`);
    return body || {};
  }

  // ---- snapshot and gateway

  function onGateway(g) {
    if (typeof g.now === 'number') state.skew = g.now - nowS();
    if (typeof g.draining === 'boolean') ui.draining.hidden = !g.draining;
    if (g.version) setText(ui.version, `v${g.version}`);
    if (g.activity_limit) state.activityLimit = g.activity_limit;
    if (g.series_step_s) state.stepS = g.series_step_s;
  }

  function onSnapshot(s) {
    onGateway(s.gateway || {});
    ui.keySection.hidden = true;

    state.models.clear();
    ui.modelsBody.replaceChildren();
    state.childModel.clear();
    for (const v of s.models || []) putModel(v);

    state.activity.clear();
    state.inFlight.clear();
    ui.activityBody.replaceChildren();
    const rows = (s.activity || []).slice(0, state.activityLimit);
    for (const r of rows) ui.activityBody.append(activityEntry(r).row);

    state.series = (s.series || []).slice();
    trimSeries();
    renderCharts();

    const selected = ui.logChild.value;
    state.logs.clear();
    ui.logs.replaceChildren();
    ui.logChild.replaceChildren();
    for (const m of state.models.values()) {
      for (const r of m.view.replicas || []) if (r.log) logPanel(r.log);
    }
    for (const l of s.logs || []) {
      if (l.model) state.childModel.set(l.child, l.model);
      appendLog(l.child, l.lines || []);
    }
    if (selected && state.logs.has(selected)) ui.logChild.value = selected;
    showChild(ui.logChild.value);

    toggleEmpty();
    setConn('live', 'live');
  }

  function toggleEmpty() {
    ui.modelsEmpty.hidden = state.models.size > 0;
    ui.modelsBody.closest('.table-wrap').hidden = state.models.size === 0;
    ui.activityEmpty.hidden = state.activity.size > 0;
    ui.activityBody.closest('.table-wrap').hidden = state.activity.size === 0;
    ui.logsEmpty.hidden = state.logs.size > 0;
    ui.logChild.parentElement.hidden = state.logs.size === 0;
  }

  // ---- models

  function putModel(view) {
    let m = state.models.get(view.id);
    if (!m) {
      m = modelRow(view.id);
      state.models.set(view.id, m);
      ui.modelsBody.append(m.row);
    }
    m.view = view;
    m.at = nowS();
    for (const r of view.replicas || []) {
      if (!r.log) continue;
      state.childModel.set(r.log, view.id);
      logPanel(r.log);
    }
    renderModel(m);
  }

  function removeModel(id) {
    const m = state.models.get(id);
    if (!m) return;
    m.row.remove();
    state.models.delete(id);
  }

  function modelRow(id) {
    // Each cell holds one box, so that the narrow layout can set it beside its label.
    const tds = [];
    const cell = (label, tag = 'td') => {
      const box = h('div', { class: 'cell' });
      tds.push(h(tag, tag === 'th' ? { scope: 'row', 'data-label': label } : { 'data-label': label }, box));
      return box;
    };
    const cells = {
      name: cell('Model', 'th'),
      state: cell('State'),
      engine: cell('Engine'),
      replicas: cell('Replicas'),
      load: cell('In flight / queued'),
      ttl: cell('TTL left'),
      actions: cell('Actions'),
    };
    cells.badge = h('span', { class: 'state' });
    cells.since = h('span', { class: 'since' });
    cells.reason = h('div', { class: 'reason' });
    cells.state.append(cells.badge, ' ', cells.since, cells.reason);
    const row = h('tr', { 'data-model': id }, ...tds);
    return { row, cells, buttons: null, view: null, at: 0 };
  }

  function renderModel(m) {
    const v = m.view;
    const c = m.cells;

    c.name.replaceChildren(h('span', { class: 'model-name' }, v.id));
    if (v.aliases && v.aliases.length) c.name.append(h('span', { class: 'aliases' }, `aliases: ${v.aliases.join(', ')}`));
    if (v.always_loaded) c.name.append(h('span', { class: 'aliases' }, 'always loaded'));

    c.badge.dataset.state = v.state;
    setText(c.badge, v.state);
    c.reason.hidden = !v.reason;
    setText(c.reason, v.reason ? (v.state === 'failed' ? v.reason : `last error: ${v.reason}`) : '');

    if (v.kind === 'engine') setText(c.engine, [v.engine, v.variant].filter(Boolean).join(' · ') || DASH);
    else setText(c.engine, 'upstream');

    c.replicas.replaceChildren(replicaList(v.replicas || []));

    c.load.replaceChildren(`${v.in_flight} / ${v.queued}`);
    if (v.max_in_flight) c.load.append(h('span', { class: 'muted' }, ` (max ${v.max_in_flight})`));

    if (v.kind === 'engine' && !m.buttons) {
      const button = (action, label) => {
        const b = h('button', { type: 'button', 'data-action': action, 'aria-label': `${label} ${v.id}` }, label);
        b.addEventListener('click', () => modelAction(v.id, action));
        return b;
      };
      m.buttons = { load: button('load', 'Load'), unload: button('unload', 'Unload') };
      c.actions.replaceChildren(m.buttons.load, m.buttons.unload);
    } else if (v.kind !== 'engine' && m.buttons) {
      m.buttons = null;
      c.actions.replaceChildren();
    }
    updateButtons(m);
    updateModelTimes(m);
  }

  function replicaList(replicas) {
    if (!replicas.length) return h('span', { class: 'muted' }, 'none');
    const list = h('ul', { class: 'replicas' });
    for (const r of replicas) {
      const health = r.healthy === true ? 'healthy' : r.healthy === false ? 'unhealthy' : null;
      const head = h('div', { class: 'replica-head' },
        h('span', { class: 'replica-name' }, r.name), ' ',
        h('span', { class: 'replica-state' }, r.state));
      if (health) head.append(' ', h('span', { class: `health ${health}` }, health));
      const details = [];
      if (r.pid != null) details.push(`pid ${r.pid}`);
      if (r.address) details.push(r.address);
      if (r.restarts != null) details.push(`${r.restarts} restart${r.restarts === 1 ? '' : 's'}`);
      if (r.in_flight) details.push(`${r.in_flight} in flight`);
      const info = h('div', { class: 'muted small' }, details.join(' · '));
      const li = h('li', { 'data-replica': r.name, 'data-state': r.state }, head, info);
      if (r.last_error) li.append(h('div', { class: 'error small' }, `last error: ${r.last_error}`));
      if (r.log) {
        const b = h('button', { type: 'button', class: 'link', 'data-action': 'show-log', 'aria-label': `Show log of ${r.log}` }, 'log');
        b.addEventListener('click', () => {
          ui.logChild.value = r.log;
          showChild(r.log);
          $('logs-section').scrollIntoView({ block: 'start' });
          ui.logChild.focus({ preventScroll: true });
        });
        info.append(details.length ? ' · ' : '', b);
      }
      list.append(li);
    }
    return list;
  }

  function updateButtons(m) {
    if (!m.buttons) return;
    const s = m.view.state;
    const id = m.view.id;
    m.buttons.load.disabled = state.busy.has(`load:${id}`) || s === 'loaded' || s === 'loading';
    m.buttons.unload.disabled = state.busy.has(`unload:${id}`) || s === 'unloaded' || s === 'unloading';
  }

  // The text that changes with time: how long a model has been loading, its TTL left.
  function updateModelTimes(m) {
    const v = m.view;
    setText(m.cells.since, v.state === 'loading' && v.since ? `for ${fmtSpan(serverNow() - v.since)}` : '');
    setText(m.cells.ttl, ttlText(v, m.at));
  }

  function ttlText(v, at) {
    if (!v.ttl_s || v.always_loaded) return 'never';
    if (v.state !== 'loaded') return DASH;
    if (v.in_flight > 0 || v.queued > 0) return `${fmtSpan(v.ttl_s)} (in use)`;
    return fmtSpan(v.ttl_s - (v.idle_s || 0) - (nowS() - at));
  }

  async function modelAction(id, action) {
    const key = `${action}:${id}`;
    if (state.busy.has(key)) return;
    state.busy.add(key);
    const refresh = () => { const m = state.models.get(id); if (m) updateButtons(m); };
    refresh();
    setMessage(ui.modelsMessage, `${action === 'load' ? 'Loading' : 'Unloading'} ${id}…`, false);
    try {
      const r = await post(`/admin/models/${encodeURIComponent(id)}/${action}`);
      setMessage(ui.modelsMessage, `${id}: ${r.state || 'done'}`, false);
    } catch (err) {
      setMessage(ui.modelsMessage, `Could not ${action} ${id}: ${err.message}`, true);
    } finally {
      state.busy.delete(key);
      refresh();
    }
  }

  // ---- activity

  function putActivity(rows) {
    const fresh = [];
    for (const r of rows) {
      const a = state.activity.get(r.id);
      if (a) fillActivity(a, r);
      else fresh.push(r);
    }
    // New rows go on top, the newest first.
    fresh.sort((x, y) => x.time - y.time);
    for (const r of fresh) ui.activityBody.prepend(activityEntry(r).row);
    while (state.activity.size > state.activityLimit) {
      const last = ui.activityBody.lastElementChild;
      if (!last) break;
      dropActivity(last.dataset.requestId);
      last.remove();
    }
  }

  function dropActivity(id) {
    state.activity.delete(id);
    state.inFlight.delete(id);
  }

  function activityEntry(r) {
    const a = { data: null, row: h('tr', { 'data-request-id': r.id }), cancel: null, duration: null };
    state.activity.set(r.id, a);
    fillActivity(a, r);
    return a;
  }

  function fillActivity(a, r) {
    a.data = r;
    const td = (text, cls) => h('td', { class: cls }, text);
    a.row.dataset.status = r.in_flight ? 'in-flight' : String(r.status ?? 'none');
    a.row.hidden = !matchesFilter(r);

    let status;
    if (r.in_flight) {
      status = h('td', { class: 'status' }, h('span', { class: 'spinner', 'aria-hidden': 'true' }), 'in flight');
    } else {
      const cls = r.status == null ? '' : r.status < 400 ? 'ok' : r.status < 500 ? 'warn' : 'bad';
      status = h('td', { class: `status ${cls}` }, r.status == null ? DASH : String(r.status));
    }
    a.duration = td(DASH, 'num');
    const api = h('td', {}, r.api || DASH);
    if (r.stream) api.append(h('span', { class: 'muted small' }, ' stream'));
    if (r.path) api.title = r.path;

    const actions = h('td', {});
    if (r.in_flight && r.cancellable) {
      if (!a.cancel) {
        a.cancel = h('button', { type: 'button', 'data-action': 'cancel', 'aria-label': `Cancel request ${r.id}` }, 'Cancel');
        a.cancel.addEventListener('click', () => cancelRequest(r.id, a.cancel));
      }
      actions.append(a.cancel);
    } else {
      a.cancel = null;
    }

    a.row.replaceChildren(
      td(fmtClock(r.time), 'time'),
      td(r.model || DASH),
      api,
      status,
      td(r.ttft_ms == null ? DASH : String(Math.round(r.ttft_ms)), 'num'),
      td(fmtNum(r.tps), 'num'),
      td(r.tokens == null ? DASH : String(r.tokens), 'num'),
      a.duration,
      td(fmtBytes(r.bytes), 'num'),
      td(r.replica || DASH),
      td(r.error || '', r.error ? 'error' : ''),
      actions,
    );
    if (r.in_flight) state.inFlight.add(r.id);
    else state.inFlight.delete(r.id);
    updateDuration(a);
  }

  function updateDuration(a) {
    const r = a.data;
    if (r.in_flight) setText(a.duration, `${fmtSpan(serverNow() - r.time)}…`);
    else setText(a.duration, fmtMs(r.duration_ms));
  }

  function matchesFilter(r) {
    return !state.filter || String(r.model || '').toLowerCase().includes(state.filter);
  }

  ui.activityFilter.addEventListener('input', () => {
    state.filter = ui.activityFilter.value.trim().toLowerCase();
    for (const a of state.activity.values()) a.row.hidden = !matchesFilter(a.data);
  });

  async function cancelRequest(id, button) {
    button.disabled = true;
    try {
      await post(`/admin/requests/${encodeURIComponent(id)}/cancel`);
      setMessage(ui.activityMessage, `Cancelled request ${id}.`, false);
    } catch (err) {
      setMessage(ui.activityMessage, `Could not cancel request ${id}: ${err.message}`, true);
      button.disabled = false;
    }
  }

  // ---- charts

  const CHARTS = [
    { key: 'rps', title: 'Requests/s', label: 'Requests per second', unit: '/s' },
    { key: 'ttft_ms', title: 'Time to first token', label: 'Time to first token', unit: ' ms' },
    { key: 'tps', title: 'Tokens/s', label: 'Tokens per second', unit: ' tok/s' },
  ];
  const W = 300;
  const TOP = 16;
  const BOTTOM = 84;
  const PAD = 3;

  function buildCharts() {
    for (const c of CHARTS) {
      c.latest = h('span', { class: 'latest' });
      c.svg = svg('svg', { viewBox: `0 0 ${W} 100`, role: 'img', class: 'chart-svg', 'data-chart': c.key });
      c.max = svg('text', { x: 2, y: 10, class: 'axis' });
      c.path = svg('path', { class: 'line' });
      c.svg.append(
        svg('line', { x1: 0, x2: W, y1: TOP, y2: TOP, class: 'grid' }),
        svg('line', { x1: 0, x2: W, y1: BOTTOM, y2: BOTTOM, class: 'base' }),
        c.max, c.path,
        Object.assign(svg('text', { x: 2, y: 97, class: 'axis' }), { textContent: '−15 min' }),
        Object.assign(svg('text', { x: W - 2, y: 97, class: 'axis end' }), { textContent: 'now' }),
      );
      ui.charts.append(h('figure', { class: 'chart', 'data-chart': c.key },
        h('figcaption', {}, h('h3', {}, c.title), c.latest), c.svg));
    }
  }

  // 1, 2 or 5 times a power of ten, at least v.
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const e = 10 ** Math.floor(Math.log10(v));
    const f = v / e;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * e;
  }

  function trimSeries() {
    const s = state.series;
    if (!s.length) return;
    const oldest = s[s.length - 1].t - SERIES_WINDOW_S;
    let i = 0;
    while (i < s.length && s[i].t < oldest) i++;
    if (i) s.splice(0, i);
  }

  function onSeries(p) {
    state.series.push(p);
    trimSeries();
    renderCharts();
  }

  function renderCharts() {
    const s = state.series;
    const end = s.length ? s[s.length - 1].t : serverNow();
    const start = end - SERIES_WINDOW_S;
    for (const c of CHARTS) {
      let top = 0;
      for (const p of s) if (p[c.key] != null && p[c.key] > top) top = p[c.key];
      const max = niceMax(top);
      const x = (t) => (PAD + (t - start) / SERIES_WINDOW_S * (W - 2 * PAD)).toFixed(1);
      const y = (v) => (BOTTOM - (v / max) * (BOTTOM - TOP)).toFixed(1);
      let d = '';
      let prev = null;
      for (const p of s) {
        const v = p[c.key];
        if (v == null) { prev = null; continue; }
        // A missing step (the gateway was away) is a gap too.
        const joined = prev && p.t - prev.t <= state.stepS * 1.5;
        d += `${joined ? 'L' : 'M'}${x(p.t)} ${y(v)}`;
        if (!joined) d += 'h0';   // a lone point shows as a dot (round caps)
        prev = p;
      }
      c.path.setAttribute('d', d || 'M0 0');
      c.path.classList.toggle('empty', !d);
      const last = s.length ? s[s.length - 1][c.key] : null;
      const latest = last == null ? DASH : `${fmtNum(last)}${c.unit}`;
      setText(c.latest, `latest ${latest}`);
      c.max.textContent = `max ${fmtNum(max, 2)}${c.unit}`;
      c.svg.setAttribute('aria-label', s.length
        ? `${c.label} over the last 15 minutes: latest ${latest}, axis max ${fmtNum(max, 2)}${c.unit}`
        : `${c.label}: no data yet`);
    }
  }

  // ---- logs

  function logPanel(child) {
    let p = state.logs.get(child);
    if (p) return p;
    const pre = h('pre', {
      class: 'log', 'data-log': child, tabindex: '0', role: 'region', 'aria-label': `Log of ${child}`,
    });
    pre.hidden = true;
    const option = h('option', { value: child }, child);
    p = { lines: [], pre, option, stick: true };
    pre.addEventListener('scroll', () => {
      p.stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
    });
    state.logs.set(child, p);
    ui.logs.append(pre);
    // Options stay sorted by name.
    const after = [...ui.logChild.options].find((o) => o.value > child);
    ui.logChild.insertBefore(option, after || null);
    if (state.logs.size === 1) showChild(child);
    toggleEmpty();
    return p;
  }

  function appendLog(child, lines) {
    if (!child) return;
    const p = logPanel(child);
    if (!lines.length) return;
    const clean = lines.map((l) => String(l).replace(ANSI, ''));
    for (const l of clean) p.lines.push(l);
    if (p.lines.length > LOG_CAP) {
      p.lines.splice(0, p.lines.length - LOG_CAP);
      p.pre.textContent = `${p.lines.join('\n')}\n`;
    } else {
      p.pre.append(`${clean.join('\n')}\n`);
    }
    if (p.stick && !p.pre.hidden) p.pre.scrollTop = p.pre.scrollHeight;
  }

  function showChild(child) {
    for (const [name, p] of state.logs) {
      p.pre.hidden = name !== child;
      if (name === child && p.stick) p.pre.scrollTop = p.pre.scrollHeight;
    }
    updateLogNote();
  }

  ui.logChild.addEventListener('change', () => showChild(ui.logChild.value));

  // Above the selected log: why its model failed, or its replica's last error.
  function updateLogNote() {
    const child = ui.logChild.value;
    const m = state.models.get(state.childModel.get(child));
    let note = '';
    if (m) {
      const r = (m.view.replicas || []).find((x) => x.log === child);
      if (m.view.state === 'failed') note = `${m.view.id} failed: ${m.view.reason || 'no reason given'}`;
      else if (r && r.last_error) note = `${r.name}: last error: ${r.last_error}`;
    }
    setMessage(ui.logNote, note, !!note);
  }

  // ---- one timer for the text that changes with time

  function tick() {
    for (const m of state.models.values()) updateModelTimes(m);
    for (const id of state.inFlight) {
      const a = state.activity.get(id);
      if (a) updateDuration(a);
    }
  }

  buildCharts();
  renderCharts();
  toggleEmpty();
  setInterval(tick, 1000);
  setConn('connecting', 'connecting…');
  connect();
})();
