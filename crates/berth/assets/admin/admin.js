// berth's admin page: a live view of nodes, instances and leases, and the
// operator's actions on them. Plain script, no build step; served by the
// berth binary itself (crates/berth/src/serve/admin.rs).
//
// Credentials. The page has two ways to call the API, chosen at sign-in:
//
// * Host mode (a base_domain is set, apps live on their own origins): the
//   admin token is exchanged once for the admin session (POST
//   /api/v1/session). The browser keeps the session cookie (HttpOnly,
//   SameSite=Strict); this page keeps only the CSRF token, in memory, and
//   sends it with every request that changes something. A reload gets the
//   CSRF token back from GET /api/v1/session.
//
// * Path mode (apps are served under /u/<user>/ on this very origin): berth
//   makes no admin sessions, since every app's script could ride on such a
//   cookie. The token is then held in this tab's memory only, in the
//   closure below, and sent as Bearer. Never in a cookie, localStorage or
//   sessionStorage: those belong to the origin, and so to every app on it,
//   which could read or use them. Apps are opened with rel=noopener, so
//   they get no handle on this tab either. A reload asks for the token
//   again.
//
// Everything the page shows comes from authenticated API calls, and is put
// into the page as text (textContent), never as markup: user ids and log
// lines are anyone's input.

'use strict';

(() => {
  const BASE = location.pathname.replace(/\/admin(\/.*)?$/, '');
  const API = BASE + '/api/v1';
  // How long the token behind an "Open" link lives.
  const OPEN_TTL_S = 3600;
  // Lines a log view keeps.
  const LOG_LINES = 2000;

  const $ = (id) => document.getElementById(id);

  // --- credentials (see the top of this file) --------------------------------

  const auth = (() => {
    let mode = null; // 'session' | 'bearer' | null
    let csrf = null;
    let token = null;
    return {
      get signedIn() { return mode !== null; },
      get mode() { return mode; },
      useSession(csrfToken) { mode = 'session'; csrf = csrfToken; token = null; },
      useBearer(adminToken) { mode = 'bearer'; token = adminToken; csrf = null; },
      forget() { mode = null; csrf = null; token = null; },
      headers(method, extra) {
        const h = new Headers(extra || {});
        if (mode === 'bearer') h.set('Authorization', 'Bearer ' + token);
        if (mode === 'session' && method !== 'GET' && method !== 'HEAD') h.set('X-Berth-CSRF', csrf);
        return h;
      },
    };
  })();

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message || code || ('HTTP ' + status));
      this.status = status;
      this.code = code;
    }
  }

  async function errorOf(response) {
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON */ }
    const code = body && body.error;
    const message = body && body.message;
    return new ApiError(response.status, code, code ? code + ': ' + message : 'HTTP ' + response.status);
  }

  // One API call. Resolves to the JSON answer (null when empty), or to the
  // response itself with `raw`.
  async function api(method, path, { body, signal, raw } = {}) {
    const extra = body === undefined ? {} : { 'Content-Type': 'application/json' };
    const response = await fetch(API + path, {
      method,
      headers: auth.headers(method, extra),
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: 'same-origin',
      cache: 'no-store',
      signal,
    });
    if (!response.ok) {
      const error = await errorOf(response);
      if (response.status === 401 && auth.signedIn) signedOut('Signed out: ' + error.message);
      throw error;
    }
    if (raw) return response;
    const text = await response.text();
    return text.trim() === '' ? null : JSON.parse(text);
  }

  const userPath = (user) => '/users/' + encodeURIComponent(user);

  // Reads a Server-Sent Events stream with fetch() (EventSource cannot send
  // an Authorization header) and calls onEvent(name, data) per event.
  async function followEvents(path, signal, onEvent) {
    const response = await api('GET', path, { signal, raw: true });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = 'message';
        const data = [];
        for (const line of block.split('\n')) {
          if (line.startsWith(':')) continue;
          const colon = line.indexOf(':');
          const field = colon < 0 ? line : line.slice(0, colon);
          let v = colon < 0 ? '' : line.slice(colon + 1);
          if (v.startsWith(' ')) v = v.slice(1);
          if (field === 'event') name = v;
          else if (field === 'data') data.push(v);
        }
        if (data.length) onEvent(name, data.join('\n'));
      }
    }
  }

  // --- small helpers ------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (k === 'text') node.textContent = v;
      else if (k === 'class') node.className = v;
      else if (k.startsWith('data-') || k === 'role') node.setAttribute(k, v);
      else node[k] = v;
    }
    for (const child of children) if (child) node.append(child);
    return node;
  }

  function duration(ms) {
    if (ms === null || ms === undefined || !isFinite(ms)) return '–';
    const s = Math.max(0, Math.floor(ms / 1000));
    if (s < 60) return s + 's';
    const m = Math.floor(s / 60);
    if (m < 60) return m + 'm ' + (s % 60) + 's';
    const h = Math.floor(m / 60);
    if (h < 24) return h + 'h ' + (m % 60) + 'm';
    return Math.floor(h / 24) + 'd ' + (h % 24) + 'h';
  }

  function relative(ms) {
    if (ms === null || ms === undefined) return '–';
    return ms >= 0 ? 'in ' + duration(ms) : duration(-ms) + ' ago';
  }

  function toast(message, kind) {
    const node = el('div', { class: 'toast ' + (kind || 'info'), role: kind === 'error' ? 'alert' : 'status', text: message });
    $('toasts').append(node);
    setTimeout(() => node.remove(), kind === 'error' ? 9000 : 4000);
  }

  // Asks before a destructive action; resolves true on Confirm.
  function confirmAction(text, verb) {
    const dialog = $('confirm');
    $('confirm-text').textContent = text;
    $('confirm-ok').textContent = verb;
    return new Promise((resolve) => {
      dialog.addEventListener('close', () => resolve(dialog.returnValue === 'ok'), { once: true });
      dialog.returnValue = '';
      dialog.showModal();
    });
  }

  // --- the live view ------------------------------------------------------------

  let view = null; // the last snapshot
  let clockOffset = 0; // server clock minus ours
  const serverNow = () => Date.now() + clockOffset;
  const busy = new Map(); // user -> what is being done ("stopping…")
  let stream = null; // AbortController of the event stream

  function startStream() {
    stopStream();
    const controller = new AbortController();
    stream = controller;
    setLive('connecting…', false);
    let delay = 500;
    (async () => {
      while (!controller.signal.aborted && auth.signedIn) {
        try {
          await followEvents('/events', controller.signal, (name, data) => {
            delay = 500;
            if (name === 'snapshot') {
              setLive('live', true);
              render(JSON.parse(data));
            } else if (name === 'error') {
              setLive('store unavailable', false);
            }
          });
        } catch (e) {
          if (controller.signal.aborted || !auth.signedIn) return;
          setLive('reconnecting… (' + e.message + ')', false);
        }
        if (controller.signal.aborted) return;
        setLive('reconnecting…', false);
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 10000);
      }
    })();
  }

  function stopStream() {
    if (stream) stream.abort();
    stream = null;
  }

  function setLive(text, ok) {
    $('live').hidden = false;
    $('live').classList.toggle('ok', ok);
    $('live-text').textContent = text;
  }

  function render(snapshot) {
    view = snapshot;
    clockOffset = snapshot.now - Date.now();
    $('where').textContent = 'via ' + snapshot.node;
    renderNodes();
    renderInstances();
    renderLeases();
    tick();
  }

  // Keeps one <tr> per key: rows are updated in place, so focus and
  // selection survive an update.
  function reconcile(table, items, keyOf, fill) {
    const tbody = $(table).tBodies[0];
    const old = new Map([...tbody.rows].map((r) => [r.dataset.key, r]));
    for (const item of items) {
      const key = keyOf(item);
      let row = old.get(key);
      old.delete(key);
      if (!row) {
        row = document.createElement('tr');
        row.dataset.key = key;
      }
      fill(row, item);
      tbody.append(row); // moves an existing row into order
    }
    for (const row of old.values()) row.remove();
    $(table + '-count').textContent = items.length ? '(' + items.length + ')' : '';
    document.querySelector('[data-empty-for="' + table + '"]').hidden = items.length > 0;
  }

  // Sets the cells of `row` to `cells` ([label, field, content, class]),
  // creating them the first time.
  function setCells(row, cells) {
    cells.forEach(([label, field, content, cls], i) => {
      let td = row.cells[i];
      if (!td) {
        td = row.insertCell();
        td.dataset.label = label;
        td.dataset.field = field;
      }
      td.className = cls || '';
      if (content instanceof Node) {
        if (td.firstChild !== content) td.replaceChildren(content);
      } else if (td.textContent !== String(content)) {
        td.textContent = String(content);
      }
    });
  }

  function badge(text, kind) {
    return el('span', { class: 'badge ' + (kind || text), text });
  }

  function renderNodes() {
    const ttl = view.lease_ttl_ms;
    const nodes = [...view.nodes].sort((a, b) => a.id.localeCompare(b.id));
    reconcile('nodes', nodes, (n) => n.id, (row, n) => {
      const stale = n.status !== 'down' && view.now - n.heartbeat > ttl;
      const name = n.id + (n.id === view.node ? ' (this node)' : '');
      setCells(row, [
        ['Node', 'id', name, 'strong'],
        ['Status', 'status', badgeCell(row, 1, stale ? n.status + ', stale' : n.status, stale ? 'stale' : n.status)],
        ['Load', 'load', n.load + ' / ' + n.capacity],
        ['Heartbeat', 'heartbeat', '', 'time'],
        ['URL', 'url', n.advertise_url, 'mono small'],
      ]);
      row.cells[3].dataset.at = n.heartbeat;
      row.cells[3].dataset.kind = 'relative';
      row.classList.toggle('warn', stale || n.status === 'down');
    });
  }

  // A badge element for a cell, reused while its text stays the same.
  function badgeCell(row, index, text, kind) {
    const current = row.cells[index] && row.cells[index].firstChild;
    if (current && current.textContent === text && current.className === 'badge ' + kind) return current;
    return badge(text, kind);
  }

  const LIVE = new Set(['starting', 'running', 'hibernated', 'crashed']);

  // Nodes whose heartbeat is older than a lease TTL (or that are down).
  function staleNodeIds() {
    return new Set(view.nodes
      .filter((n) => n.status === 'down' || view.now - n.heartbeat > view.lease_ttl_ms)
      .map((n) => n.id));
  }
  let staleNodes = new Set();

  function renderInstances() {
    staleNodes = staleNodeIds();
    const instances = [...view.instances].sort((a, b) =>
      a.user.localeCompare(b.user) || a.role.localeCompare(b.role));
    reconcile('instances', instances, (i) => i.user + '\u0000' + i.role, (row, i) => {
      const breaker = i.role === 'main' ? view.breakers[i.user] : null;
      const live = LIVE.has(i.status);
      let status = i.status + (i.status === 'running' && !i.ready ? ' (not ready)' : '');
      // A live record on a node that stopped heartbeating is only what
      // that node last wrote.
      const stale = live && staleNodes.has(i.node);
      if (stale) status += ', node stale';
      const user = i.role === 'main' ? i.user : i.user + ' · ' + i.role;
      row.dataset.user = i.user;
      row.dataset.role = i.role;
      row.dataset.status = i.status;
      setCells(row, [
        ['User', 'user', user, 'strong'],
        ['Status', 'status', badgeCell(row, 1, status, stale ? 'stale' : i.status)],
        ['Node', 'node', i.node],
        ['Epoch', 'epoch', i.epoch],
        ['Uptime', 'uptime', '', 'time'],
        ['Restarts', 'restarts', i.restarts, i.restarts > 0 ? 'warn-text' : ''],
        ['Idle', 'idle', '', 'time'],
        ['Breaker', 'breaker', breaker ? 'open until ' + new Date(breaker.cooldown_until).toLocaleTimeString() +
          ' (' + breaker.opens + '×)' : 'closed', breaker ? 'error-text' : 'muted'],
        ['Actions', 'actions', actionsFor(row, i, live, breaker), 'actions'],
      ]);
      setClock(row.cells[4], live ? i.started_at : null, 'since');
      setClock(row.cells[6], i.status === 'running' || i.status === 'hibernated' ? i.last_active : null, 'since');
      row.title = i.last_error ? 'last error: ' + i.last_error : '';
    });
  }

  function setClock(td, at, kind) {
    if (at === null || at === undefined) {
      delete td.dataset.at;
      td.textContent = '–';
    } else {
      td.dataset.at = at;
      td.dataset.kind = kind;
    }
  }

  // The buttons of an instance row; rebuilt only when they change.
  function actionsFor(row, i, live, breaker) {
    const doing = busy.get(i.user);
    let actions = [];
    if (i.role === 'main') {
      actions = live ? ['stop', 'restart', 'probe'] : ['start', 'probe'];
      // Frozen with its memory intact: it wakes by hand or on its next request.
      if (i.status === 'running' && i.ready) actions.push('hibernate');
      if (i.status === 'hibernated') actions.push('resume');
      if (breaker) actions.push('reset');
      actions.push('logs', 'open');
    }
    const signature = actions.join(',') + '|' + (doing || '');
    const current = row.cells[8] && row.cells[8].firstChild;
    if (current && current.dataset.signature === signature) return current;
    const box = el('div', { class: 'buttons', 'data-signature': signature });
    if (doing) box.append(el('span', { class: 'busy', text: doing }));
    for (const action of actions) {
      const spec = ACTIONS[action];
      const button = el('button', {
        type: 'button',
        class: spec.danger ? 'small danger-outline' : 'small',
        text: spec.label,
        'data-action': action,
        disabled: Boolean(doing) && action !== 'logs' && action !== 'open',
      });
      button.addEventListener('click', () => spec.run(i.user));
      box.append(button);
    }
    return box;
  }

  function renderLeases() {
    const leases = [...view.leases].sort((a, b) =>
      (b.expired - a.expired) || a.user.localeCompare(b.user));
    reconcile('leases', leases, (l) => l.user, (row, l) => {
      const state = l.expired ? 'expired' : l.released ? 'released' : 'held';
      let detail = state;
      if (l.expired && l.holder_alive === false) detail = 'expired, holder down';
      if (l.expired && l.holder_alive === true) detail = 'expired, holder alive';
      row.dataset.user = l.user;
      row.classList.toggle('expired', l.expired);
      let actions = row.cells[5] && row.cells[5].firstChild;
      const signature = l.expired ? 'takeover' : '';
      if (!actions || actions.dataset.signature !== signature) {
        actions = el('div', { class: 'buttons', 'data-signature': signature });
        if (l.expired) {
          const b = el('button', { type: 'button', class: 'small danger-outline', text: 'Take over', 'data-action': 'takeover' });
          b.addEventListener('click', () => takeOver(l.user, l.holder));
          actions.append(b);
        }
      }
      setCells(row, [
        ['User', 'user', l.user, 'strong'],
        ['Holder', 'holder', l.holder || '–'],
        ['Epoch', 'epoch', l.epoch],
        ['Until', 'until', '', 'time'],
        ['State', 'state', badgeCell(row, 4, detail, state)],
        ['Actions', 'actions', actions, 'actions'],
      ]);
      setClock(row.cells[3], l.released ? null : l.lease_until, 'relative');
    });
  }

  // Counts the clocks on between snapshots.
  function tick() {
    const now = serverNow();
    for (const td of document.querySelectorAll('td[data-at]')) {
      const at = Number(td.dataset.at);
      const text = td.dataset.kind === 'relative' ? relative(at - now) : duration(now - at);
      if (td.textContent !== text) td.textContent = text;
    }
  }
  setInterval(() => { if (view) tick(); }, 1000);

  // --- actions ------------------------------------------------------------------

  async function act(user, doing, call, done) {
    busy.set(user, doing);
    if (view) renderInstances();
    try {
      const answer = await call();
      if (done) toast(done(answer), 'ok');
    } catch (e) {
      toast(user + ': ' + e.message, 'error');
    } finally {
      busy.delete(user);
      if (view) renderInstances();
    }
  }

  const ACTIONS = {
    start: {
      label: 'Start',
      run: (user) => act(user, 'starting…',
        () => api('POST', userPath(user) + '/instance?wait=false', { body: {} }),
        () => user + ': starting'),
    },
    stop: {
      label: 'Stop', danger: true,
      run: async (user) => {
        if (!await confirmAction('Stop ' + user + "'s instance? Unsaved work in it is lost.", 'Stop')) return;
        act(user, 'stopping…', () => api('DELETE', userPath(user) + '/instance'), () => user + ': stopped');
      },
    },
    restart: {
      label: 'Restart', danger: true,
      run: async (user) => {
        if (!await confirmAction('Restart ' + user + "'s instance? Its process is replaced.", 'Restart')) return;
        act(user, 'restarting…', () => api('POST', userPath(user) + '/instance/restart'), () => user + ': restarted');
      },
    },
    probe: {
      label: 'Probe', danger: true,
      run: async (user) => {
        if (!await confirmAction('Probe ' + user + ': restart the instance and check that it stays up?', 'Probe')) return;
        act(user, 'probing…', () => api('POST', userPath(user) + '/instance/probe'),
          (r) => user + ': probe ' + (r && r.ok ? 'ok' : 'FAILED' + (r && r.reason ? ': ' + r.reason : '')));
      },
    },
    reset: {
      label: 'Reset breaker', danger: true,
      run: async (user) => {
        if (!await confirmAction('Reset ' + user + "'s crash breaker? A crashing program may start looping again.", 'Reset')) return;
        act(user, 'resetting…', () => api('POST', userPath(user) + '/breaker/reset'), () => user + ': breaker reset');
      },
    },
    hibernate: {
      label: 'Hibernate',
      run: (user) => act(user, 'hibernating…', () => api('POST', userPath(user) + '/instance/hibernate'),
        () => user + ': hibernated'),
    },
    resume: {
      label: 'Resume',
      run: (user) => act(user, 'resuming…', () => api('POST', userPath(user) + '/instance/resume'),
        () => user + ': resumed'),
    },
    logs: { label: 'Logs', run: (user) => openLogs(user) },
    open: { label: 'Open', run: (user) => openApp(user) },
  };

  async function takeOver(user, holder) {
    const text = 'Take over ' + user + "'s expired lease from " + (holder || 'its holder') +
      ' and start the user on this node? The old holder is fenced.';
    if (!await confirmAction(text, 'Take over')) return;
    act(user, 'taking over…', () => api('POST', '/leases/' + encodeURIComponent(user) + '/takeover'),
      (r) => user + ': taken over' + (r && r.instance ? ' by ' + r.instance.node : ''));
  }

  // Mints a token of `user`'s and shows the link that opens their app as
  // them, the link `berth token USER` prints: on the user's own host in
  // host mode, under /u/<user>/ of this origin in path mode.
  async function openApp(user) {
    try {
      const minted = await api('POST', userPath(user) + '/tokens', { body: { ttl_s: OPEN_TTL_S } });
      const url = minted.routing === 'host'
        ? minted.url
        : location.origin + BASE + '/u/' + encodeURIComponent(user) + '/?berth_token=' + encodeURIComponent(minted.token);
      $('opener-user').textContent = user;
      $('opener-ttl').textContent = duration(OPEN_TTL_S * 1000);
      const link = $('opener-link');
      link.href = url;
      link.textContent = 'Open ' + user + "'s app";
      $('opener').showModal();
    } catch (e) {
      toast(user + ': ' + e.message, 'error');
    }
  }

  // --- the log view ----------------------------------------------------------------

  let logs = null; // AbortController of the followed log

  function openLogs(user) {
    closeLogs();
    const controller = new AbortController();
    logs = controller;
    const pre = $('logs-lines');
    pre.replaceChildren();
    $('logs-user').textContent = user;
    $('logs-state').textContent = 'connecting…';
    $('logs').hidden = false;
    document.body.classList.add('with-drawer');
    (async () => {
      try {
        await followEvents(userPath(user) + '/instance/logs?tail=200&follow=true', controller.signal, (name, data) => {
          if (name !== 'line') return;
          $('logs-state').textContent = 'following';
          let line;
          try { line = JSON.parse(data); } catch (_) { line = data; }
          const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
          pre.append(el('span', { class: 'line', text: line + '\n' }));
          while (pre.childElementCount > LOG_LINES) pre.firstChild.remove();
          if (atBottom) pre.scrollTop = pre.scrollHeight;
        });
        if (!controller.signal.aborted) $('logs-state').textContent = 'ended';
      } catch (e) {
        if (!controller.signal.aborted) $('logs-state').textContent = e.message;
      }
    })();
  }

  function closeLogs() {
    if (logs) logs.abort();
    logs = null;
    $('logs').hidden = true;
    document.body.classList.remove('with-drawer');
  }

  // --- signing in and out -------------------------------------------------------

  function showApp() {
    $('login').hidden = true;
    $('app').hidden = false;
    $('sign-out').hidden = false;
    startStream();
  }

  function signedOut(message) {
    auth.forget();
    stopStream();
    closeLogs();
    view = null;
    $('app').hidden = true;
    $('sign-out').hidden = true;
    $('live').hidden = true;
    $('where').textContent = '';
    $('login').hidden = false;
    const error = $('login-error');
    error.hidden = !message;
    error.textContent = message || '';
    $('token').focus();
  }

  async function signIn(token) {
    const response = await fetch(API + '/session', {
      method: 'POST',
      headers: { Authorization: 'Bearer ' + token },
      credentials: 'same-origin',
      cache: 'no-store',
    });
    if (response.status === 201) {
      auth.useSession((await response.json()).csrf_token);
      return;
    }
    if (response.status !== 403) throw await errorOf(response);
    // 403: the token is the admin's, but berth makes no admin sessions while
    // apps share this origin (path mode). Keep the token in memory only.
    const check = await fetch(API + '/nodes', {
      headers: { Authorization: 'Bearer ' + token },
      cache: 'no-store',
    });
    if (!check.ok) throw await errorOf(check);
    auth.useBearer(token);
  }

  $('login-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    const input = $('token');
    const token = input.value.trim();
    $('sign-in').disabled = true;
    try {
      await signIn(token);
      input.value = '';
      $('login-error').hidden = true;
      showApp();
    } catch (e) {
      $('login-error').hidden = false;
      $('login-error').textContent = e.message;
    } finally {
      $('sign-in').disabled = false;
    }
  });

  $('sign-out').addEventListener('click', async () => {
    if (auth.mode === 'session') {
      try { await api('DELETE', '/session'); } catch (_) { /* signed out either way */ }
    }
    signedOut('');
  });

  $('start-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const user = $('start-user').value.trim();
    if (!user) return;
    $('start-user').value = '';
    ACTIONS.start.run(user);
  });

  $('logs-close').addEventListener('click', closeLogs);
  // The link opens a tab of its own; this one goes back to the overview.
  $('opener-link').addEventListener('click', () => $('opener').close());

  // A reloaded page resumes its session, if it has one.
  (async () => {
    try {
      const response = await fetch(API + '/session', { credentials: 'same-origin', cache: 'no-store' });
      if (response.ok) {
        auth.useSession((await response.json()).csrf_token);
        showApp();
        return;
      }
    } catch (_) { /* no session */ }
    signedOut('');
  })();
})();
