// A real OpenID Provider for berth's tests: npm's `oidc-provider` (an
// OpenID-certified implementation), configured by the test, with login
// pages that check passwords and test-only controls to rotate its signing
// keys and to tamper with what its token endpoint returns.
//
//   node oidc_provider.mjs CONFIG.json
//
// Needs BERTH_TEST_NODE_MODULES: the node_modules folder scripts/test
// installs oidc-provider into. CONFIG.json:
//
//   port       the loopback port to listen on (required)
//   issuer     defaults to http://127.0.0.1:<port>
//   keys_file  the private RS256 JWK set: read when it exists, else made
//              (from `jwks` when given, else a fresh key) and written, so
//              a restarted provider signs with the keys it had
//   jwks       optional first private JWK set ({"keys": [...]})
//   clients    [{client_id, client_secret, redirect_uris, ...}]: any other
//              client metadata is passed on as it is
//   users      [{sub, password, username?, email?, preferred_username?,
//              groups?, ...}]: everything but password and username is a
//              claim; one logs in as `username`, else `preferred_username`,
//              else `sub`
//
// Prints "oidc-provider listening on <issuer>" once it accepts connections.
//
// Test controls, on the same port (never part of a real provider):
//   GET  /__test/mode            {"mode": "..."}
//   POST /__test/mode            {"mode": "..."}: see MODES; "none" resets
//   POST /__test/rotate          {"keep_old": true}: a new signing key (new
//                                kid) signs from now on; the old keys stay
//                                in the JWKS unless keep_old is false.
//                                Answers {"kid": new, "kids": published}
//   POST /__test/users           replaces the users (same shape as config)
//   POST /__test/verify          {"jwt": "..."}: checks only the signature
//                                against the published JWKS; answers
//                                {"valid": bool, "kid", "error"}
//
// Sessions, codes and tokens live in memory: a restarted provider has none.

import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';
import * as crypto from 'node:crypto';
import * as fs from 'node:fs';
import * as http from 'node:http';

const nodeModules = process.env.BERTH_TEST_NODE_MODULES;
if (!nodeModules) {
  console.error('oidc_provider.mjs: BERTH_TEST_NODE_MODULES is not set (scripts/test installs oidc-provider)');
  process.exit(2);
}
// ES modules ignore NODE_PATH: resolve from the installed folder instead.
const resolveInstalled = createRequire(`${nodeModules.replace(/\/$/, '')}/`).resolve;
const { default: Provider } = await import(pathToFileURL(resolveInstalled('oidc-provider')).href);

const configPath = process.argv[2];
if (!configPath) {
  console.error('usage: oidc_provider.mjs CONFIG.json');
  process.exit(2);
}
const config = JSON.parse(fs.readFileSync(configPath, 'utf8'));
const port = Number(config.port);
const issuer = config.issuer ?? `http://127.0.0.1:${port}`;
let users = config.users ?? [];

// What the token endpoint's answer is made into, by mode. Each makes an ID
// token that is wrong in one way; all but bad_signature, alg_none and
// foreign_key are signed properly with the provider's current key, so only
// the claim in question gives them away.
const MODES = new Set([
  'none',
  'bad_signature', // the signature's bytes flipped
  'wrong_audience', // aud names another client
  'wrong_issuer', // iss names another provider
  'expired', // exp and iat more than an hour ago
  'wrong_nonce', // a nonce other than the one the client sent
  'missing_nonce', // no nonce at all
  'alg_none', // unsigned: header alg "none", empty signature
  'foreign_key', // signed with a key the JWKS does not publish
  'pkce_mismatch', // the code_verifier is altered on its way in: invalid_grant
]);
let mode = 'none';

// --- signing keys -------------------------------------------------------

function newSigningKey() {
  const { privateKey } = crypto.generateKeyPairSync('rsa', { modulusLength: 2048 });
  return {
    ...privateKey.export({ format: 'jwk' }),
    kid: `k-${crypto.randomBytes(6).toString('hex')}`,
    alg: 'RS256',
    use: 'sig',
  };
}

function loadKeys() {
  if (config.keys_file && fs.existsSync(config.keys_file)) {
    return JSON.parse(fs.readFileSync(config.keys_file, 'utf8')).keys;
  }
  const keys = config.jwks?.keys?.map((k) => ({ alg: 'RS256', use: 'sig', ...k })) ?? [newSigningKey()];
  saveKeys(keys);
  return keys;
}

function saveKeys(keys) {
  if (config.keys_file) {
    fs.writeFileSync(config.keys_file, JSON.stringify({ keys }), { mode: 0o600 });
  }
}

// Newest first: oidc-provider signs with the first key that fits, so the
// head of this list is the current signing key.
let keys = loadKeys();
// Only for foreign_key: never published.
const foreignKey = newSigningKey();

// --- JWTs -------------------------------------------------------------------

const b64url = (buf) => Buffer.from(buf).toString('base64url');
const jsonSegment = (value) => b64url(JSON.stringify(value));
const parseSegment = (segment) => JSON.parse(Buffer.from(segment, 'base64url').toString('utf8'));

function signRS256(signingInput, jwk) {
  const key = crypto.createPrivateKey({ key: jwk, format: 'jwk' });
  return b64url(crypto.sign('sha256', Buffer.from(signingInput), key));
}

function tamper(idToken) {
  const [headerSeg, payloadSeg, signatureSeg] = idToken.split('.');
  const header = parseSegment(headerSeg);
  const claims = parseSegment(payloadSeg);
  const now = Math.floor(Date.now() / 1000);
  const resign = (payload, jwk = keys[0], head = headerSeg) => {
    const input = `${head}.${jsonSegment(payload)}`;
    return `${input}.${signRS256(input, jwk)}`;
  };
  switch (mode) {
    case 'bad_signature': {
      const signature = Buffer.from(signatureSeg, 'base64url');
      signature[Math.floor(signature.length / 2)] ^= 0xff;
      return `${headerSeg}.${payloadSeg}.${b64url(signature)}`;
    }
    case 'wrong_audience':
      return resign({ ...claims, aud: 'some-other-client', azp: undefined });
    case 'wrong_issuer':
      return resign({ ...claims, iss: 'http://wrong-issuer.invalid' });
    case 'expired':
      return resign({ ...claims, iat: now - 7200, exp: now - 3600, auth_time: now - 7200 });
    case 'wrong_nonce':
      return resign({ ...claims, nonce: `not-${claims.nonce ?? 'the-nonce'}` });
    case 'missing_nonce': {
      const { nonce, ...rest } = claims;
      return resign(rest);
    }
    case 'alg_none':
      return `${jsonSegment({ alg: 'none', typ: header.typ ?? 'JWT' })}.${payloadSeg}.`;
    case 'foreign_key':
      return resign(claims, foreignKey, jsonSegment({ ...header, kid: foreignKey.kid }));
    default:
      return idToken;
  }
}

function verifySignature(jwt) {
  const [headerSeg, payloadSeg, signatureSeg] = String(jwt).split('.');
  let header;
  try {
    header = parseSegment(headerSeg);
  } catch {
    return { valid: false, error: 'the header is not JSON' };
  }
  if (header.alg !== 'RS256') return { valid: false, kid: header.kid, error: `alg ${header.alg}` };
  const jwk = keys.find((k) => k.kid === header.kid);
  if (!jwk) return { valid: false, kid: header.kid, error: 'no published key has this kid' };
  const { d, p, q, dp, dq, qi, ...pub } = jwk;
  const valid = crypto.verify(
    'sha256',
    Buffer.from(`${headerSeg}.${payloadSeg}`),
    crypto.createPublicKey({ key: pub, format: 'jwk' }),
    Buffer.from(signatureSeg ?? '', 'base64url'),
  );
  return valid ? { valid, kid: header.kid } : { valid, kid: header.kid, error: 'signature mismatch' };
}

// --- pages --------------------------------------------------------------------

const escape = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function page(title, body) {
  return `<!DOCTYPE html><html><head><meta charset="utf-8"><title>${escape(title)}</title></head>`
    + `<body><h1>${escape(title)}</h1>${body}</body></html>`;
}

function loginPage(uid, clientId, { username = '', error } = {}) {
  return page('Sign in', `<p id="client">${escape(clientId)}</p>`
    + (error ? `<p id="error">${escape(error)}</p>` : '')
    + `<form id="login" method="post" action="/interaction/${escape(uid)}/login">`
    + `<label>Username <input id="username" name="username" autocomplete="username" value="${escape(username)}"></label>`
    + '<label>Password <input id="password" name="password" type="password" autocomplete="current-password"></label>'
    + '<button id="submit" type="submit">Sign in</button></form>');
}

const loginName = (u) => u.username ?? u.preferred_username ?? u.sub;

function claimsOf(user) {
  const { password, username, ...claims } = user;
  return claims;
}

// --- the provider ---------------------------------------------------------------

// Sessions are signed with these; one set per process, like the sessions.
const cookieKeys = [crypto.randomBytes(32).toString('hex')];

function buildProvider() {
  const provider = new Provider(issuer, {
    clients: (config.clients ?? []).map((c) => ({
      response_types: ['code'],
      grant_types: ['authorization_code', 'refresh_token'],
      token_endpoint_auth_method: 'client_secret_basic',
      ...c,
    })),
    // A confidential client authenticates with its secret, in the way its
    // token_endpoint_auth_method names (client_secret_basic unless the
    // test says client_secret_post).
    clientAuthMethods: ['client_secret_basic', 'client_secret_post'],
    jwks: { keys },
    cookies: { keys: cookieKeys },
    claims: {
      openid: ['sub'],
      email: ['email', 'email_verified'],
      profile: ['name', 'preferred_username'],
      groups: ['groups'],
    },
    scopes: ['openid', 'offline_access', 'email', 'profile', 'groups'],
    // berth reads who signed in from the ID token: the claims of the
    // granted scopes go there too, not only to userinfo.
    conformIdTokenClaims: false,
    pkce: { methods: ['S256'], required: () => true },
    features: {
      devInteractions: { enabled: false },
      rpInitiatedLogout: {
        enabled: true,
        logoutSource: async (ctx, form) => {
          ctx.body = page('Sign out', `${form}<button id="logout" type="submit" form="op.logoutForm" name="logout" value="yes">Sign out</button>`
            + '<button id="stay" type="submit" form="op.logoutForm">Stay signed in</button>');
        },
        postLogoutSuccessSource: async (ctx) => {
          ctx.body = page('Signed out', '<p id="signed-out">You are signed out.</p>');
        },
      },
    },
    interactions: { url: async (ctx, interaction) => `/interaction/${interaction.uid}` },
    findAccount: async (ctx, sub) => {
      const user = users.find((u) => u.sub === sub);
      if (!user) return undefined;
      return { accountId: sub, claims: async () => claimsOf(user) };
    },
    renderError: async (ctx, out) => {
      ctx.type = 'html';
      ctx.body = page('Error', `<p id="error">${escape(out.error)}</p><p id="error-description">${escape(out.error_description ?? '')}</p>`);
    },
  });

  provider.on('server_error', (ctx, err) => console.error('oidc-provider server_error:', err));

  // The tamper modes, around the token endpoint.
  provider.use(async (ctx, next) => {
    const token = ctx.method === 'POST' && ctx.path === '/token';
    if (token && mode === 'pkce_mismatch') {
      // Read the form here and hand oidc-provider the altered one (it
      // takes an already read body from req.body).
      const form = new URLSearchParams(await readBody(ctx.req));
      const verifier = form.get('code_verifier');
      if (verifier) {
        // Same length and alphabet, so the request stays well formed and
        // only the S256 check fails.
        const last = verifier.at(-1) === 'A' ? 'B' : 'A';
        form.set('code_verifier', verifier.slice(0, -1) + last);
      }
      ctx.req.body = form.toString();
    }
    await next();
    if (token && mode !== 'none' && typeof ctx.body?.id_token === 'string') {
      ctx.body = { ...ctx.body, id_token: tamper(ctx.body.id_token) };
    }
  });
  return provider;
}

let provider = buildProvider();
let handle = provider.callback();

// --- HTTP ----------------------------------------------------------------------

async function readBody(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return Buffer.concat(chunks).toString('utf8');
}

function send(res, status, type, body) {
  res.writeHead(status, { 'content-type': type, 'cache-control': 'no-store' });
  res.end(body);
}
const sendJson = (res, status, value) => send(res, status, 'application/json', JSON.stringify(value));
const sendHtml = (res, status, html) => send(res, status, 'text/html; charset=utf-8', html);

async function jsonBody(req) {
  const text = await readBody(req);
  return text.trim() ? JSON.parse(text) : {};
}

async function control(req, res, path) {
  if (path === '/__test/mode' && req.method === 'GET') return sendJson(res, 200, { mode });
  if (path === '/__test/mode' && req.method === 'POST') {
    const { mode: wanted } = await jsonBody(req);
    if (!MODES.has(wanted)) return sendJson(res, 400, { error: `unknown mode ${wanted}`, modes: [...MODES] });
    mode = wanted;
    return sendJson(res, 200, { mode });
  }
  if (path === '/__test/rotate' && req.method === 'POST') {
    const { keep_old: keepOld = true } = await jsonBody(req);
    const key = newSigningKey();
    keys = keepOld ? [key, ...keys] : [key];
    saveKeys(keys);
    // oidc-provider fixes its keys when made: a new one takes over the
    // same sessions, codes and grants (they live in a shared store).
    provider = buildProvider();
    handle = provider.callback();
    return sendJson(res, 200, { kid: key.kid, kids: keys.map((k) => k.kid) });
  }
  if (path === '/__test/users' && req.method === 'POST') {
    const body = await jsonBody(req);
    if (!Array.isArray(body)) return sendJson(res, 400, { error: 'users must be a JSON array' });
    users = body;
    return sendJson(res, 200, { users: users.length });
  }
  if (path === '/__test/verify' && req.method === 'POST') {
    const { jwt } = await jsonBody(req);
    return sendJson(res, 200, verifySignature(jwt));
  }
  return sendJson(res, 404, { error: 'no such test control' });
}

async function interaction(req, res, path) {
  const [, , uid, action] = path.split('/');
  const details = await provider.interactionDetails(req, res);
  if (details.uid !== uid) return sendHtml(res, 400, page('Error', '<p id="error">interaction mismatch</p>'));
  const { prompt, params } = details;
  if (req.method === 'GET' && !action) {
    if (prompt.name === 'login') return sendHtml(res, 200, loginPage(uid, params.client_id));
    if (prompt.name === 'consent') {
      // Consent is granted at once: the test's client is first-party.
      const grant = details.grantId
        ? await provider.Grant.find(details.grantId)
        : new provider.Grant({ accountId: details.session.accountId, clientId: params.client_id });
      const missing = prompt.details;
      if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
      if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
      for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes ?? {})) {
        grant.addResourceScope(indicator, scopes.join(' '));
      }
      const grantId = await grant.save();
      return provider.interactionFinished(req, res, { consent: { grantId } }, { mergeWithLastSubmission: true });
    }
    return sendHtml(res, 500, page('Error', `<p id="error">unexpected prompt ${escape(prompt.name)}</p>`));
  }
  if (req.method === 'POST' && action === 'login' && prompt.name === 'login') {
    const form = new URLSearchParams(await readBody(req));
    const username = form.get('username') ?? '';
    const password = form.get('password') ?? '';
    const user = users.find((u) => loginName(u) === username);
    const expected = Buffer.from(String(user?.password ?? ''));
    const given = Buffer.from(password);
    const ok = user !== undefined && expected.length === given.length && crypto.timingSafeEqual(expected, given);
    if (!ok) {
      return sendHtml(res, 401, loginPage(uid, params.client_id, { username, error: 'Wrong username or password.' }));
    }
    return provider.interactionFinished(req, res, { login: { accountId: user.sub } }, { mergeWithLastSubmission: false });
  }
  return sendHtml(res, 405, page('Error', '<p id="error">not allowed here</p>'));
}

const server = http.createServer(async (req, res) => {
  const path = new URL(req.url, issuer).pathname;
  try {
    if (path.startsWith('/__test/')) return await control(req, res, path);
    if (path.startsWith('/interaction/')) return await interaction(req, res, path);
    return handle(req, res);
  } catch (err) {
    console.error(`oidc-provider harness: ${req.method} ${path}:`, err);
    if (!res.headersSent) sendHtml(res, 400, page('Error', `<p id="error">${escape(err.message ?? err)}</p>`));
    else res.end();
  }
});

function shutdown() {
  server.close(() => process.exit(0));
  server.closeAllConnections();
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);

server.listen(port, '127.0.0.1', () => {
  console.log(`oidc-provider listening on ${issuer}`);
});
