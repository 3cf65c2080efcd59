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
    main: $('main'), conn: $('conn'), version: $('version'), draining: $('draining'), stale: $('stale'),
    keySection: $('key-section'), keyForm: $('key-form'), keyInput: $('key-input'), keyMessage: $('key-message'),
    keySubmit: $('key-submit'),
    sections: ['models-section', 'charts-section', 'activity-section', 'logs-section'].map($),
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
    live: false,             // a stream is open and its snapshot came: what the page shows is current
    haveData: false,         // a snapshot was shown (and not forgotten since)
    everLive: false,         // some snapshot came since the page opened
    locked: false,           // waiting for an API key: the gateway's state is not shown
    failures: 0,             // connection attempts that failed in a row
    lastData: 0,             // when the stream last said something (this clock, s)
    lastError: '',           // why the last attempt failed, when the gateway answered with an error
    draining: false,         // the gateway said it is shutting down
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
  let probeTimer = 0;

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
    stopProbe();
    if (controller) controller.abort();
    const ctl = controller = new AbortController();
    let stall = 0;
    let opened = false;     // the gateway answered with a stream
    const alive = () => { clearTimeout(stall); stall = setTimeout(() => ctl.abort(), STALL_MS); };
    state.lastError = '';
    try {
      alive();
      const res = await fetch('/events', {
        headers: authHeaders({ Accept: 'text/event-stream' }), cache: 'no-store', signal: ctl.signal,
      });
      if (res.status === 401) {
        clearTimeout(stall);
        if (ctl !== controller) return;
        needKey(state.key ? 'That API key was refused. Enter it again.'
          : state.everLive ? 'The gateway now asks for an API key.' : '');
        return;
      }
      if (!res.ok || !res.body) {
        state.lastError = `HTTP ${res.status}`;
        throw new Error(state.lastError);
      }
      opened = true;
      state.lastError = '';
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      const feed = sseParser(dispatch);
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        alive();
        if (state.live) state.lastData = nowS();
        feed(decoder.decode(value, { stream: true }));
      }
    } catch (err) {
      if (ctl !== controller) return;   // replaced by a newer connection
    } finally {
      clearTimeout(stall);
    }
    if (ctl !== controller) return;
    lost(opened);
  }

  // The stream ended or could not be opened: what the page shows is no longer current.
  function lost(opened) {
    state.failures = opened ? 0 : state.failures + 1;
    if (state.live) state.lastData = nowS();
    setLive(false);
    if (state.failures === 0) setConn('reconnecting', 'reconnecting…');
    else setConn('offline', state.lastError ? `error (${state.lastError})` : 'not answering');
    if (state.locked && state.failures) {
      // A key was entered, and the gateway does not answer to try it.
      setMessage(ui.keyMessage, state.lastError
        ? `The gateway answered ${state.lastError}. Trying again…`
        : 'The gateway does not answer. Trying again…', true);
    }
    showStale();
    // 1-2 s after a stream ends; a little longer while the gateway stays away.
    const delay = 1000 + Math.random() * 1000 + Math.min(state.failures, 4) * 1000;
    retryTimer = setTimeout(connect, delay);
  }

  function setLive(live) {
    state.live = live;
    ui.main.classList.toggle('stale', !live && state.haveData);
    refreshControls();
  }

  // While not live, the last state shown stays, dimmed, with when it was current.
  function showStale() {
    const stale = !state.live && !state.locked && (state.haveData || state.failures > 0);
    ui.stale.hidden = !stale;
    if (stale) {
      // Whether the gateway still drains is not known: the notice says it was.
      ui.draining.hidden = true;
      const asOf = state.haveData && state.lastData ? ` Shown as of ${fmtClock(state.lastData)}.` : '';
      const was = state.draining ? 'The gateway was shutting down; now it' : 'The gateway';
      const why = state.failures === 0 ? 'The connection to the gateway was lost; reconnecting…'
        : state.lastError ? `${was} answers ${state.lastError}; retrying.`
          : `${was} is not answering; retrying.`;
      setText(ui.stale, `${why}${asOf}`);
    } else {
      ui.draining.hidden = !state.draining;
    }
  }

  // Waiting for a key, the page still tells whether the gateway is there at all.
  function stopProbe() { clearTimeout(probeTimer); probeTimer = 0; }

  function startProbe() {
    stopProbe();
    probeTimer = setTimeout(probe, 5000);
  }

  let gone = false;   // the probe found no gateway while waiting for a key

  async function probe() {
    let answered = false;
    try {
      await fetch('/livez', { cache: 'no-store' });
      answered = true;
    } catch (err) {
      answered = false;
    }
    if (!state.locked || controller || !probeTimer) return;   // a key was entered meanwhile
    if (!answered) {
      if (!gone) {
        gone = true;
        setConn('offline', 'not answering');
        setMessage(ui.keyMessage, 'The gateway does not answer.', true);
      }
    } else if (gone) {
      gone = false;
      setConn('needs-key', 'needs key');
      setMessage(ui.keyMessage, '', false);
    }
    probeTimer = setTimeout(probe, answered ? 5000 : 3000);
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
    state.failures = 0;
    gone = false;
    // Without a key the gateway's state is not to be seen: what was shown goes.
    forget();
    setLocked(true);
    setLive(false);
    showStale();
    setConn('needs-key', 'needs key');
    setMessage(ui.keyMessage, message, !!message);
    ui.keyInput.focus();
    startProbe();
  }

  // Locked: only the key form; the sections of the gateway's state stay hidden.
  function setLocked(locked) {
    state.locked = locked;
    ui.keySection.hidden = !locked;
    for (const s of ui.sections) s.hidden = locked;
  }

  ui.keyForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const key = ui.keyInput.value.trim();
    if (!key) return;
    state.key = key;
    sessionStorage.setItem(KEY_STORE, key);
    ui.keyInput.value = '';
    state.failures = 0;
    gone = false;
    // The form stays until the gateway takes the key (its snapshot) or refuses it.
    setMessage(ui.keyMessage, 'Checking the key…', false);
    setConn('connecting', 'connecting…');
    connect();
  });

  // POST an admin action; the error envelope's message becomes the thrown error's.
  async function post(path) {
    const res = await fetch(path, { method: 'POST', headers: authHeaders(), cache: 'no-store' });
    let body = null;
    try { body = await res.json(); } catch (err) { body = null; }
    if (res.status === 401) {
      needKey(state.key ? 'The API key was refused. Enter it again.' : 'The gateway now asks for an API key.');
      throw new Error('the API key was refused');
    }
    if (!res.ok) throw new Error((body && body.error && body.error.message) || `HTTP ${res.status}`);
    return body || {};
  }

  // ---- snapshot and gateway

  function onGateway(g) {
    if (typeof g.now === 'number') state.skew = g.now - nowS();
    if (typeof g.draining === 'boolean') {
      state.draining = g.draining;
      showStale();
    }
    if (g.version) setText(ui.version, `v${g.version}`);
    if (g.activity_limit) state.activityLimit = g.activity_limit;
    if (g.series_step_s) state.stepS = g.series_step_s;
  }

  function onSnapshot(s) {
    // The snapshot decides everything, the draining banner included.
    state.draining = false;
    onGateway(s.gateway || {});
    stopProbe();
    gone = false;
    state.failures = 0;
    state.haveData = true;
    state.everLive = true;
    state.lastData = nowS();
    setLocked(false);
    setMessage(ui.keyMessage, '', false);

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
    setLive(true);
    showStale();
  }

  // Forget the gateway's state (a key is needed to see it).
  function forget() {
    state.haveData = false;
    state.models.clear();
    ui.modelsBody.replaceChildren();
    state.childModel.clear();
    state.activity.clear();
    state.inFlight.clear();
    ui.activityBody.replaceChildren();
    state.series = [];
    renderCharts();
    state.logs.clear();
    ui.logs.replaceChildren();
    ui.logChild.replaceChildren();
    setMessage(ui.logNote, '', false);
    setMessage(ui.modelsMessage, '', false);
    setMessage(ui.activityMessage, '', false);
    setText(ui.version, '');
    state.draining = false;
    toggleEmpty();
  }

  // "No models yet" and the like only once the gateway said so (a snapshot), not before.
  function toggleEmpty() {
    const known = state.haveData;
    ui.modelsEmpty.hidden = !known || state.models.size > 0;
    ui.modelsBody.closest('.table-wrap').hidden = state.models.size === 0;
    ui.activityEmpty.hidden = !known || state.activity.size > 0;
    ui.activityBody.closest('.table-wrap').hidden = state.activity.size === 0;
    ui.logsEmpty.hidden = !known || state.logs.size > 0;
    ui.logChild.parentElement.hidden = state.logs.size === 0;
  }

  // The buttons that act on the gateway work only while the page shows its current state.
  function refreshControls() {
    for (const m of state.models.values()) updateButtons(m);
    for (const a of state.activity.values()) {
      if (a.cancel) a.cancel.disabled = !state.live || a.cancelling;
    }
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
      // healthy is null where the replica is not meant to run (an unloaded model): no badge then.
      const health = r.healthy === true ? 'healthy' : r.healthy === false ? 'unhealthy' : null;
      const stateText = h('span', { class: 'replica-state' });
      if (r.state === 'starting' || r.state === 'restarting') {
        stateText.append(h('span', { class: 'spinner', 'aria-hidden': 'true' }));
      }
      stateText.append(r.state);
      const head = h('div', { class: 'replica-head' },
        h('span', { class: 'replica-name' }, r.name), ' ', stateText);
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
    const off = !state.live;
    m.buttons.load.disabled = off || state.busy.has(`load:${id}`) || s === 'loaded' || s === 'loading';
    m.buttons.unload.disabled = off || state.busy.has(`unload:${id}`) || s === 'unloaded' || s === 'unloading';
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

  // A row's key: unique among the rows (clients may give two requests one x-request-id).
  const rowKey = (r) => String(r.key ?? r.id);

  function putActivity(rows) {
    const fresh = [];
    for (const r of rows) {
      const a = state.activity.get(rowKey(r));
      if (a) fillActivity(a, r);
      else fresh.push(r);
    }
    // New rows go on top, the newest first.
    fresh.sort((x, y) => x.time - y.time);
    for (const r of fresh) ui.activityBody.prepend(activityEntry(r).row);
    while (state.activity.size > state.activityLimit) {
      const last = ui.activityBody.lastElementChild;
      if (!last) break;
      dropActivity(last.dataset.key);
      last.remove();
    }
  }

  function dropActivity(id) {
    state.activity.delete(id);
    state.inFlight.delete(id);
  }

  function activityEntry(r) {
    const a = { data: null, row: h('tr', { 'data-request-id': r.id, 'data-key': rowKey(r) }), cancel: null, duration: null };
    state.activity.set(rowKey(r), a);
    fillActivity(a, r);
    return a;
  }

  // One row: its cells follow the table's header, one for one (a test finds "Tokens/s" by its
  // header). The status cell also holds the error code and, in flight, the Cancel button, so
  // that both stay in sight on a narrow screen.
  function fillActivity(a, r) {
    a.data = r;
    const td = (text, cls, label) => h('td', { class: cls, 'data-label': label }, text);
    a.row.dataset.status = r.in_flight ? 'in-flight' : String(r.status ?? 'none');
    a.row.hidden = !matchesFilter(r);

    let status;
    if (r.in_flight) {
      status = h('td', { class: 'status' },
        h('span', { class: 'code' }, h('span', { class: 'spinner', 'aria-hidden': 'true' }), 'in flight'));
    } else {
      const cls = r.status == null ? '' : r.status < 400 ? 'ok' : r.status < 500 ? 'warn' : 'bad';
      status = h('td', { class: `status ${cls}` }, h('span', { class: 'code' }, r.status == null ? DASH : String(r.status)));
    }
    if (r.in_flight && r.cancellable) {
      if (!a.cancel) {
        a.cancel = h('button', { type: 'button', 'data-action': 'cancel', 'aria-label': `Cancel request ${r.id}` }, 'Cancel');
        a.cancel.addEventListener('click', () => cancelRequest(r.id, a));
      }
      a.cancel.disabled = !state.live || !!a.cancelling;
      status.append(' ', a.cancel);
    } else {
      a.cancel = null;
    }
    if (r.error) status.append(h('span', { class: 'error-code' }, r.error));

    a.duration = td(DASH, 'num', 'Duration');
    const api = h('td', { class: 'api' }, r.api || DASH);
    if (r.stream) api.append(h('span', { class: 'muted small' }, ' stream'));
    if (r.path) api.title = r.path;

    a.row.replaceChildren(
      td(fmtClock(r.time), 'time'),
      td(r.model || DASH, 'model'),
      api,
      status,
      td(r.ttft_ms == null ? DASH : `${Math.round(r.ttft_ms)} ms`, 'num ttft', 'TTFT'),
      td(fmtNum(r.tps), 'num tps', 'Tokens/s'),
      td(r.tokens == null ? DASH : String(r.tokens), 'num tokens', 'Tokens'),
      a.duration,
      td(fmtBytes(r.bytes), 'num bytes', 'Bytes'),
      td(r.replica || DASH, 'replica'),
    );
    if (r.in_flight) state.inFlight.add(rowKey(r));
    else state.inFlight.delete(rowKey(r));
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

  async function cancelRequest(id, a) {
    a.cancelling = true;
    if (a.cancel) a.cancel.disabled = true;
    try {
      await post(`/admin/requests/${encodeURIComponent(id)}/cancel`);
      setMessage(ui.activityMessage, `Cancelled request ${id}.`, false);
    } catch (err) {
      setMessage(ui.activityMessage, `Could not cancel request ${id}: ${err.message}`, true);
    } finally {
      a.cancelling = false;
      if (a.cancel) a.cancel.disabled = !state.live;
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
      c.dots = svg('path', { class: 'dots' });
      c.nodata = svg('text', { x: W / 2, y: (TOP + BOTTOM) / 2 + 4, class: 'nodata' });
      c.nodata.textContent = 'no data yet';
      c.svg.append(
        svg('line', { x1: 0, x2: W, y1: TOP, y2: TOP, class: 'grid' }),
        svg('line', { x1: 0, x2: W, y1: BOTTOM, y2: BOTTOM, class: 'base' }),
        c.max, c.path, c.dots, c.nodata,
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
      let known = 0;   // points with a value
      for (const p of s) {
        const v = p[c.key];
        if (v == null) continue;
        known++;
        if (v > top) top = v;
      }
      const max = niceMax(top);
      const x = (t) => (PAD + (t - start) / SERIES_WINDOW_S * (W - 2 * PAD)).toFixed(1);
      const y = (v) => (BOTTOM - (v / max) * (BOTTOM - TOP)).toFixed(1);
      let d = '';
      let dots = '';
      let prev = null;
      for (let i = 0; i < s.length; i++) {
        const p = s[i];
        const v = p[c.key];
        if (v == null) { prev = null; continue; }
        // A missing step (the gateway was away) is a gap too.
        const joined = prev && p.t - prev.t <= state.stepS * 1.5;
        const next = s[i + 1];
        const joinedNext = next && next[c.key] != null && next.t - p.t <= state.stepS * 1.5;
        d += `${joined ? 'L' : 'M'}${x(p.t)} ${y(v)}`;
        // A lone point (or the last one) shows as a dot: a line through one point draws nothing.
        if (!joined && !joinedNext) dots += `M${x(p.t)} ${y(v)}h0`;
        prev = p;
      }
      const last = s.length ? s[s.length - 1] : null;
      if (last && last[c.key] != null) dots += `M${x(last.t)} ${y(last[c.key])}h0`;
      c.path.setAttribute('d', d || 'M0 0');
      c.path.classList.toggle('empty', !d);
      c.dots.setAttribute('d', dots || 'M0 0');
      c.dots.classList.toggle('empty', !dots);
      c.nodata.classList.toggle('empty', known > 0);
      // The newest step's value (none: no request in that step).
      const latest = !last || last[c.key] == null ? DASH : `${fmtNum(last[c.key])}${c.unit}`;
      setText(c.latest, known ? `latest ${latest}` : '');
      // An axis only for what was measured: no made-up scale over no data (nor over zeros).
      c.max.textContent = top > 0 ? `max ${fmtNum(max, 2)}${c.unit}` : known ? `0${c.unit}` : '';
      c.svg.setAttribute('aria-label', known
        ? `${c.label} over the last 15 minutes: latest ${latest}` + (top > 0 ? `, axis max ${fmtNum(max, 2)}${c.unit}` : '')
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
    // Stale data stands still: no loading time, TTL or in-flight duration counts on.
    if (!state.live) return;
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
