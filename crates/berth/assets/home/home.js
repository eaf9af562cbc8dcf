// A signed-in user's home page on the berth host: their instance's state,
// its actions, the last lines of its output, and their API tokens. Plain
// script, no build step; served by the berth binary (serve/home.rs).
//
// Credentials: the session cookie berth set at sign-in (HttpOnly). This
// page keeps only the session's CSRF token, in memory, and sends it with
// every request that changes something. Everything shown is put into the
// page as text, never as markup: log lines are the program's output.

'use strict';

(() => {
  const API = '/api/v1';
  const REFRESH_MS = 3000;
  const LOG_LINES = 40;
  const $ = (id) => document.getElementById(id);
  let csrf = null;
  let user = null;
  let busy = false;

  async function api(method, path, body) {
    const headers = new Headers();
    if (method !== 'GET') headers.set('X-Berth-CSRF', csrf);
    if (body !== undefined) headers.set('Content-Type', 'application/json');
    const response = await fetch(API + path, {
      method, headers, credentials: 'same-origin', cache: 'no-store',
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.status === 401) { location.assign('/login?next=/'); throw new Error('signed out'); }
    let answer = null;
    try { answer = await response.json(); } catch (_) { /* empty */ }
    if (!response.ok) {
      const why = answer && answer.message ? answer.message : 'HTTP ' + response.status;
      throw new Error(why);
    }
    return answer;
  }

  const userPath = () => '/users/' + encodeURIComponent(user);

  function ago(ms) {
    if (!ms) return '';
    const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
    if (s < 60) return s + ' s ago';
    if (s < 3600) return Math.round(s / 60) + ' min ago';
    if (s < 86400) return Math.round(s / 3600) + ' h ago';
    return new Date(ms).toLocaleString();
  }

  function say(text, error) {
    const m = $('message');
    m.textContent = text;
    m.className = 'message' + (error ? ' error' : '');
  }

  function show(status) {
    const main = status && status.main;
    const breaker = status && status.breaker;
    const state = breaker ? 'breaker open' : main ? main.status : 'not running';
    const badge = $('state');
    badge.textContent = state;
    badge.className = 'badge ' + (breaker ? 'breaker' : main ? main.status : '');
    let since = '';
    if (breaker) since = 'until ' + new Date(breaker.cooldown_until).toLocaleTimeString();
    else if (main && main.status === 'hibernated') since = 'since ' + ago(main.hibernated_at);
    else if (main) since = 'since ' + ago(main.started_at);
    $('since').textContent = since;
    $('detail').textContent = main && main.last_error ? 'Last error: ' + main.last_error : '';
    const live = main && ['starting', 'running', 'hibernated'].includes(main.status);
    $('start').disabled = busy || Boolean(live);
    $('restart').disabled = busy || !main;
    $('stop').disabled = busy || !live;
    $('hibernate').disabled = busy || !(main && main.status === 'running');
  }

  async function refresh() {
    try {
      show(await api('GET', userPath() + '/instance'));
      const logs = await api('GET', userPath() + '/instance/logs?tail=' + LOG_LINES);
      const pre = $('log');
      pre.textContent = (logs.lines || []).join('\n');
      pre.scrollTop = pre.scrollHeight;
    } catch (e) {
      say(e.message, true);
    }
  }

  async function act(label, method, path, body) {
    busy = true;
    say(label + '…');
    try {
      await api(method, userPath() + path, body);
      say(label + ': done.');
    } catch (e) {
      say(label + ': ' + e.message, true);
    } finally {
      busy = false;
      await refresh();
    }
  }

  async function tokens() {
    const answer = await api('GET', userPath() + '/tokens');
    const body = $('tokens').tBodies[0];
    body.replaceChildren();
    let signedIn = 0;
    for (const t of answer.tokens || []) {
      // A sign-in's own tokens end with it; they are counted, not listed.
      if (t.id.startsWith('login-')) { signedIn += 1; continue; }
      const row = document.createElement('tr');
      for (const text of [t.id, new Date(t.expires_at).toLocaleString(), t.last_used_at ? ago(t.last_used_at) : 'never']) {
        const cell = document.createElement('td');
        cell.textContent = text;
        row.append(cell);
      }
      const cell = document.createElement('td');
      const revoke = document.createElement('button');
      revoke.type = 'button';
      revoke.textContent = 'Revoke';
      revoke.setAttribute('aria-label', 'Revoke token ' + t.id);
      revoke.addEventListener('click', async () => {
        try {
          await api('DELETE', userPath() + '/tokens/' + encodeURIComponent(t.id));
          say('Token ' + t.id + ' revoked.');
        } catch (e) { say(e.message, true); }
        await tokens();
      });
      cell.append(revoke);
      row.append(cell);
      body.append(row);
    }
    $('signed-in-browsers').textContent = signedIn ? 'Signed-in browser tokens: ' + signedIn + ' (they end when you sign out).' : '';
  }

  async function main() {
    const session = await api('GET', '/session');
    csrf = session.csrf_token;
    user = session.user;
    if (!user) { say('This session has no user.', true); return; }
    $('who').textContent = 'signed in as ' + user + (session.admin ? ' (admin)' : '');
    $('open').href = session.app_url;
    $('start').addEventListener('click', () => act('Start', 'POST', '/instance', {}));
    $('restart').addEventListener('click', () => act('Restart', 'POST', '/instance/restart', {}));
    $('hibernate').addEventListener('click', () => act('Hibernate', 'POST', '/instance/hibernate', {}));
    $('stop').addEventListener('click', () => act('Stop', 'DELETE', '/instance'));
    // Signing out goes through fetch, which sends this page's Origin (a
    // form would send "null" under this page's no-referrer policy).
    $('sign-out').addEventListener('submit', async (event) => {
      event.preventDefault();
      try {
        await fetch('/logout', { method: 'POST', credentials: 'same-origin', headers: { 'X-Berth-CSRF': csrf } });
      } finally {
        location.assign('/logout');
      }
    });
    $('mint').addEventListener('submit', async (event) => {
      event.preventDefault();
      try {
        const minted = await api('POST', userPath() + '/tokens', { ttl_s: Number($('ttl').value) });
        $('minted-token').textContent = minted.token;
        $('minted').hidden = false;
        say('Token ' + minted.id + ' minted.');
      } catch (e) { say(e.message, true); }
      await tokens();
    });
    await refresh();
    await tokens();
    setInterval(() => { if (!busy) refresh(); }, REFRESH_MS);
  }

  main().catch((e) => say(e.message, true));
})();
