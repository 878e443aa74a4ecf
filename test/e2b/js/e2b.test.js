// E2B's JavaScript SDK (pinned in package.json), unchanged, against the
// gateway: every call here is what an E2B user writes.
import assert from 'node:assert/strict'
import { randomBytes, createHash, randomUUID } from 'node:crypto'
import { after, afterEach, before, describe } from 'node:test'

import { CommandExitError, FileType, FilesystemEventType, InvalidArgumentError, NotFoundError, Sandbox, Template, waitForFile } from 'e2b'

import { execFileSync, spawn } from 'node:child_process'
import { mkdirSync, mkdtempSync, symlinkSync, writeFileSync } from 'node:fs'
import { request } from 'node:http'
import { connect } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { guardedTest, start } from './cluster.js'

// A Python server holding a random value and a hit counter in memory.
const heldState = `
import http.server, json, os, random
value = random.getrandbits(48)
hits = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits, value
        hits += 1
        if self.path.startswith("/set/"):
            value = int(self.path[5:])
        body = json.dumps({"value": value, "hits": hits, "pid": os.getpid()}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
`

async function startServer(sb) {
  await sb.files.write('server.py', heldState)
  await sb.commands.run('python3 server.py', { background: true })
  for (let i = 0; i < 100; i++) {
    const r = await sb.commands.run('curl -s 127.0.0.1:8000/ >/dev/null && echo up || true')
    if (r.stdout.trim() === 'up') return
    await new Promise((r) => setTimeout(r, 100))
  }
  throw new Error('server did not come up')
}

async function query(sb, path = '/') {
  return JSON.parse((await sb.commands.run(`curl -s 127.0.0.1:8000${path}`)).stdout)
}

const state = { cluster: null, failed: false }
const made = []

async function create(opts = {}) {
  const sb = await Sandbox.create({ timeoutMs: 300_000, ...opts })
  made.push(sb)
  return sb
}

describe('E2B JavaScript SDK through the OpenDsec gateway', () => {
  before(async () => {
    state.cluster = await start()
  })
  after(async () => {
    if (state.cluster?.stop) await state.cluster.stop({ keepState: state.failed })
  })
  afterEach(async () => {
    while (made.length) {
      await made.pop().kill().catch(() => {})
    }
  })
  const it = guardedTest(state)

  it('runs commands: stdout, stderr, exit code, env, cwd, user', async () => {
    const sb = await create({ envs: { FROM_CREATE: 'yes' } })
    const r = await sb.commands.run('echo out; echo err >&2; whoami; pwd; echo $FROM_CREATE')
    assert.equal(r.stdout, 'out\nuser\n/home/user\nyes\n')
    assert.equal(r.stderr, 'err\n')
    assert.equal(r.exitCode, 0)

    await assert.rejects(sb.commands.run('echo before; exit 5'), (e) => {
      assert.ok(e instanceof CommandExitError)
      assert.equal(e.exitCode, 5)
      assert.equal(e.stdout, 'before\n')
      return true
    })
    const r2 = await sb.commands.run('echo $X in $(pwd)', { envs: { X: 'hi' }, cwd: '/tmp' })
    assert.equal(r2.stdout, 'hi in /tmp\n')
    assert.equal((await sb.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
  })

  it('streams a background command, takes stdin and kills a process', async () => {
    const sb = await create()
    const seen = []
    let handle
    // Any failure on the way rejects: a lost error must fail the test, not
    // leave it waiting for output that never comes.
    const answered = new Promise((resolve, reject) => {
      const onStdout = async (d) => {
        try {
          seen.push(d)
          if (d.includes('ready')) await sb.commands.sendStdin((await started).pid, 'one\n')
          if (d.includes('got one')) {
            await sb.commands.sendStdin(handle.pid, 'two\n')
            await sb.commands.closeStdin(handle.pid)
            resolve()
          }
        } catch (e) {
          reject(e)
        }
      }
      const started = sb.commands.run('echo ready; read line; echo got $line; cat', { background: true, stdin: true, onStdout })
      started.then((h) => (handle = h), reject)
    })
    // The command only goes on when the streamed "ready" was answered.
    await answered
    const r = await handle.wait()
    assert.equal(r.stdout, 'ready\ngot one\ntwo\n')
    assert.equal(seen.join(''), r.stdout)

    const sleeper = await sb.commands.run('sleep 600', { background: true })
    assert.ok((await sb.commands.list()).some((p) => p.pid === sleeper.pid))
    assert.equal(await sb.commands.kill(sleeper.pid), true)
    await assert.rejects(sleeper.wait(), CommandExitError)
    assert.ok(!(await sb.commands.list()).some((p) => p.pid === sleeper.pid))
  })

  it('writes, reads, lists, renames and removes files', async () => {
    const sb = await create()
    const info = await sb.files.write('notes/a.txt', 'first')
    assert.equal(info.path, '/home/user/notes/a.txt')
    assert.equal(await sb.files.read('notes/a.txt'), 'first')
    assert.equal((await sb.files.getInfo('notes/a.txt')).owner, 'user')

    const blob = randomBytes(1 << 20)
    await sb.files.write('/tmp/blob.bin', blob)
    assert.deepEqual(Buffer.from(await sb.files.read('/tmp/blob.bin', { format: 'bytes' })), blob)
    const sum = (await sb.commands.run("sha256sum /tmp/blob.bin | cut -d' ' -f1")).stdout.trim()
    assert.equal(sum, createHash('sha256').update(blob).digest('hex'))

    await sb.files.write([
      { path: 'multi/x', data: 'X' },
      { path: 'multi/y', data: 'Y' },
    ])
    const names = (await sb.files.list('multi')).map((e) => e.name).sort()
    assert.deepEqual(names, ['x', 'y'])
    assert.equal((await sb.files.list('multi'))[0].type, FileType.FILE)
    assert.equal(await sb.files.exists('multi/x'), true)
    assert.equal(await sb.files.makeDir('made/deep'), true)
    assert.equal(await sb.files.makeDir('made/deep'), false)

    const moved = await sb.files.rename('multi/x', 'multi/z')
    assert.equal(moved.path, '/home/user/multi/z')
    assert.equal(await sb.files.read('multi/z'), 'X')
    await sb.files.remove('multi')
    assert.equal(await sb.files.exists('multi/z'), false)
    await assert.rejects(sb.files.read('no/such/file'), NotFoundError)
  })

  it('keeps file metadata as user.e2b.* attributes', async () => {
    // Issue 23 item 8: metadata on upload, shown by getInfo, list and
    // rename, replaced by an overwrite, refused when invalid.
    const sb = await create()
    const md = { author: 'mish', purpose: 'upload' }
    assert.deepEqual((await sb.files.write('meta/a.txt', 'x', { metadata: md })).metadata, md)
    assert.deepEqual((await sb.files.getInfo('meta/a.txt')).metadata, md)
    const listed = await sb.files.list('meta')
    assert.deepEqual(listed.map((e) => e.metadata), [md])
    assert.deepEqual((await sb.files.rename('meta/a.txt', 'meta/b.txt')).metadata, md)
    assert.equal((await sb.files.write('meta/b.txt', 'again')).metadata, undefined)
    assert.equal((await sb.files.getInfo('meta/b.txt')).metadata, undefined)
    await assert.rejects(sb.files.write('meta/bad.txt', 'x', { metadata: { 'bad key': 'v' } }), InvalidArgumentError)
    assert.equal(await sb.files.exists('meta/bad.txt'), false)
  })

  it('runs a PTY session and resizes it', async () => {
    const sb = await create()
    const chunks = []
    const term = await sb.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)) })
    await sb.pty.resize(term.pid, { cols: 100, rows: 30 })
    await sb.pty.sendInput(term.pid, new TextEncoder().encode('stty size; echo pty-$((6*7)); exit\n'))
    await term.wait()
    const text = Buffer.concat(chunks).toString()
    assert.match(text, /30 100/)
    assert.match(text, /pty-42/)
  })

  it('lists by metadata, reports info, sets the timeout and kills', async () => {
    const tag = randomUUID()
    const sb = await create({ metadata: { suite: tag } })
    const info = await sb.getInfo()
    assert.equal(info.sandboxId, sb.sandboxId)
    assert.equal(info.templateId, 'base')
    assert.deepEqual(info.metadata, { suite: tag })
    assert.equal(info.state, 'running')

    const found = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
    assert.deepEqual(
      found.map((s) => s.sandboxId),
      [sb.sandboxId],
    )
    assert.deepEqual(await Sandbox.list({ query: { metadata: { suite: 'x' + tag } } }).nextItems(), [])

    await sb.setTimeout(600_000)
    const end = (await sb.getInfo()).endAt
    assert.ok(end.getTime() - Date.now() > 500_000, `endAt ${end.toISOString()} is not ~10 minutes away`)

    assert.equal(await sb.isRunning(), true)
    await sb.kill()
    assert.equal(await sb.isRunning(), false)
    assert.deepEqual(await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems(), [])
    await assert.rejects(Sandbox.connect(sb.sandboxId), NotFoundError)
  })

  it('pauses, then connect resumes with processes and memory kept', async () => {
    const sb = await create()
    await startServer(sb)
    const before = await query(sb, '/set/4242')
    assert.equal(await sb.pause(), true)
    assert.equal((await sb.getInfo()).state, 'paused')
    // Probing a paused sandbox says so and does not wake it.
    assert.equal(await sb.isRunning(), false)
    assert.equal((await sb.getInfo()).state, 'paused')

    const resumed = await Sandbox.connect(sb.sandboxId)
    assert.equal((await resumed.getInfo()).state, 'running')
    const now = await query(resumed)
    assert.equal(now.value, 4242)
    assert.equal(now.pid, before.pid)
    assert.equal(now.hits, before.hits + 1)
  })

  it('pauses on its timeout with lifecycle onTimeout pause, and connect resumes it with its memory', async () => {
    const sb = await create({ lifecycle: { onTimeout: 'pause', autoResume: true }, timeoutMs: 10_000 })
    assert.deepEqual((await sb.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: true })
    await startServer(sb)
    const before = await query(sb, '/set/31337')
    const deadline = Date.now() + 60_000
    while ((await sb.getInfo()).state !== 'paused') {
      assert.ok(Date.now() < deadline, 'not paused a minute after its timeout')
      await new Promise((r) => setTimeout(r, 500))
    }
    assert.equal(await sb.isRunning(), false)
    const back = await Sandbox.connect(sb.sandboxId, { timeoutMs: 120_000 })
    assert.equal((await back.getInfo()).state, 'running')
    const after = await query(back)
    assert.equal(after.value, 31337)
    assert.equal(after.pid, before.pid)
  })

  it('stays paused without auto-resume until connect', async () => {
    const sb = await create({ lifecycle: { onTimeout: 'pause', autoResume: false }, timeoutMs: 3_000 })
    assert.deepEqual((await sb.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: false })
    await sb.files.write('kept.txt', 'before the pause')
    const deadline = Date.now() + 60_000
    while ((await sb.getInfo()).state !== 'paused') {
      assert.ok(Date.now() < deadline, 'not paused a minute after its timeout')
      await new Promise((r) => setTimeout(r, 500))
    }
    assert.equal(await sb.isRunning(), false)
    // The SDK raises it as E2B's own proxy answer: not running.
    await assert.rejects(sb.commands.run('true', { requestTimeoutMs: 30_000 }), /paused|not running/)
    assert.equal((await sb.getInfo()).state, 'paused')
    const back = await Sandbox.connect(sb.sandboxId, { timeoutMs: 120_000 })
    assert.equal((await back.getInfo()).state, 'running')
    assert.equal(await back.files.read('kept.txt'), 'before the pause')
  })

  it('forks into copies that carry memory and diverge', async () => {
    const sb = await create()
    await startServer(sb)
    const src = await query(sb, '/set/777')
    const forks = await sb.fork({ count: 2, timeoutMs: 120_000 })
    for (const f of forks) if (f instanceof Sandbox) made.push(f)
    assert.ok(
      forks.every((f) => f instanceof Sandbox),
      String(forks),
    )
    assert.equal(new Set(forks.map((f) => f.sandboxId)).size, 2)
    for (const f of forks) {
      const st = await query(f)
      assert.equal(st.value, 777)
      assert.equal(st.hits, src.hits + 1)
    }
    await query(forks[0], '/set/1')
    assert.equal((await query(forks[1])).value, 777)
    assert.equal((await query(sb)).value, 777)
  })

  it('reports modes and symlinks as envd does, and removes what is not there', async () => {
    const sb = await create()
    await sb.files.makeDir('d')
    assert.equal((await sb.files.getInfo('d')).mode, 0o755)
    await sb.files.write('target.txt', 'x')
    await sb.commands.run('cd /home/user && ln -s d dlink && ln -s target.txt flink')
    const info = await sb.files.getInfo('dlink')
    assert.equal(info.type, FileType.DIR)
    assert.equal(info.symlinkTarget, '/home/user/d')
    const flink = (await sb.files.list('.')).find((e) => e.name === 'flink')
    assert.equal(flink.type, FileType.FILE)
    assert.equal(flink.symlinkTarget, '/home/user/target.txt')
    await sb.files.remove('never-was-here')
    assert.equal(await Sandbox.kill('not-a-sandbox-id'), false)
  })

  it('watches: one WRITE per write, entries with includeEntry', async () => {
    // Issue 13 items 7 and 11: an overwrite gave two WRITEs; includeEntry
    // was refused for the envd version reported.
    const sb = await create()
    await sb.files.makeDir('w')
    const events = []
    let ended
    const done = new Promise((resolve) => (ended = resolve))
    const handle = await sb.files.watchDir('w', (e) => {
      events.push(e)
      if (e.name === 'end') ended()
    }, { includeEntry: true, allowNetworkMounts: true }) // envd 0.6.4's flag is taken
    await sb.files.write('w/a.txt', 'first')
    await sb.files.write('w/a.txt', 'second, longer')
    await sb.files.write('w/end', '')
    await done
    await handle.stop()
    const a = events.filter((e) => e.name === 'a.txt')
    assert.equal(a[0].type, FilesystemEventType.CREATE)
    assert.equal(a.filter((e) => e.type === FilesystemEventType.WRITE).length, 2, JSON.stringify(a))
    const last = a.filter((e) => e.type === FilesystemEventType.WRITE).pop()
    assert.equal(last.entry?.path, '/home/user/w/a.txt')
    assert.equal(last.entry?.type, FileType.FILE)
  })

  it('answers the metrics of a time range', async () => {
    // Issue 13 item 6: samples by range, recorded every 5 s from the start.
    const sb = await create()
    await sb.commands.run('sleep 6')
    const all = await sb.getMetrics()
    assert.ok(all.length >= 2, JSON.stringify(all))
    for (let i = 1; i < all.length; i++) assert.ok(all[i].timestamp > all[i - 1].timestamp)
    for (const m of all) assert.ok(m.cpuCount >= 1 && m.memUsed > 0 && m.memUsed <= m.memTotal)
    const started = (await sb.getInfo()).startedAt
    const before = await sb.getMetrics({ start: new Date(started.getTime() - 3_600_000), end: new Date(started.getTime() - 60_000) })
    assert.deepEqual(before, [])
  })

  it('ends the stream of a command in a killed sandbox as E2B does', async () => {
    const sb = await create()
    const handle = await sb.commands.run('while true; do echo tick; sleep 0.1; done', { background: true })
    await new Promise((r) => setTimeout(r, 1000))
    assert.equal(await Sandbox.kill(sb.sandboxId), true)
    await assert.rejects(handle.wait(), (err) => {
      // As E2B's sandboxKilledDuringRun.test.ts: the connection is cut,
      // the SDK's health probe hears the sandbox is gone, and says so.
      assert.equal(err.name, 'TimeoutError', `${err.name}: ${err.message}`)
      assert.match(err.message, /sandbox was killed or reached its end of life/)
      return true
    })
  })

  it('an MCP gateway that fails to start kills the created sandbox, as on E2B', async () => {
    // As E2B's 'MCP gateway start failure kills the created sandbox': the SDK
    // runs mcp-gateway in the new sandbox, which the base image lacks.
    const metadata = { mcpCleanup: String(Date.now()) }
    await assert.rejects(Sandbox.create('base', { timeoutMs: 60_000, metadata, mcp: { invalid_server: {} } }), (e) => {
      assert.match(e.message, /Failed to start MCP gateway/)
      return true
    })
    const left = await Sandbox.list({ query: { state: ['running'], metadata } }).nextItems()
    assert.deepEqual(left, [])
  })

  it('honours a shortened timeout on time', async () => {
    const sb = await create()
    await sb.setTimeout(2_000)
    await new Promise((r) => setTimeout(r, 2_400))
    assert.equal(await sb.isRunning(), false)
  })

  it('serves signed file URLs for what they were signed for', async () => {
    const sb = await create()
    await sb.files.write('signed.txt', 'signed content')
    const url = await sb.downloadUrl('signed.txt')
    let r = await fetch(url)
    assert.equal(r.status, 200)
    assert.equal(await r.text(), 'signed content')
    const form = new FormData()
    form.append('file', new Blob(['uploaded content']), 'uploaded.txt')
    r = await fetch(await sb.uploadUrl('uploaded.txt'), { method: 'POST', body: form })
    assert.equal(r.status, 200)
    assert.equal(await sb.files.read('uploaded.txt'), 'uploaded content')
    assert.equal((await fetch(url.replace('signed.txt', 'uploaded.txt'))).status, 401)
  })

  it('names snapshots and starts sandboxes by the name', async () => {
    const sb = await create()
    await sb.files.write('state.txt', 'kept')
    const name = `state-${randomBytes(4).toString('hex')}`
    const snap = await sb.createSnapshot({ name })
    assert.ok(snap.names.includes(name), JSON.stringify(snap))
    const fromName = await Sandbox.create(name, { timeoutMs: 120_000 })
    made.push(fromName)
    assert.equal(await fromName.files.read('state.txt'), 'kept')
    assert.equal(await Sandbox.deleteSnapshot(name), true)
  })

  it('has a boot id that a pause keeps', async () => {
    const sb = await create()
    const first = (await sb.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout.trim()
    assert.match(first, /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/)
    await sb.pause()
    const again = await Sandbox.connect(sb.sandboxId)
    assert.equal((await again.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout.trim(), first)
  })

  it('reaches an allowed host with allowInternetAccess and serves a page through getHost', async () => {
    const net = ownInternet()
    try {
      await until(net.web, 8080)
      const sb = await create({ allowInternetAccess: true, network: { allowOut: [net.web] } })
      const r = await sb.commands.run(`curl -s --max-time 5 ${net.url}`)
      assert.equal(r.stdout, "hello from the test's own internet\n")
      await sb.commands.run('python3 -m http.server 8000 --bind 0.0.0.0', { background: true })
      for (let i = 0; i < 100; i++) {
        const up = await sb.commands.run('curl -s 127.0.0.1:8000/ >/dev/null && echo up || true')
        if (up.stdout.trim() === 'up') break
        await new Promise((r) => setTimeout(r, 100))
      }
      const host = sb.getHost(8000)
      assert.ok(host.startsWith(`8000-${sb.sandboxId}.`), host)
      const page = await getVia(process.env.E2B_API_URL, host)
      assert.equal(page.status, 200)
      assert.match(page.body, /Directory listing/)
    } finally {
      net.close()
    }
  })

  it('builds a template from files and steps, and creates sandboxes of it', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'e2b-tpl-'))
    mkdirSync(join(dir, 'folder'))
    writeFileSync(join(dir, 'folder', 'test.txt'), 'This is a test file.')
    writeFileSync(join(dir, 'folder', 'other.txt'), 'other')
    symlinkSync('test.txt', join(dir, 'folder', 'symlink.txt'))
    writeFileSync(join(dir, 'tool.sh'), '#!/bin/sh\necho tool\n')
    const template = Template({ fileContextPath: dir })
      .fromBaseImage()
      .copy('folder/*', 'folder')
      .copy('tool.sh', '/opt/bin/', { mode: 0o755 })
      .runCmd('cat folder/symlink.txt')
      .setEnvs({ GREETING: 'hello' })
      .setWorkdir('/app')
      .setStartCmd('echo started > /tmp/started', waitForFile('/tmp/started'))
    const name = `js-tpl-${randomBytes(3).toString('hex')}`
    const logs = []
    const info = await Template.build(template, name, { cpuCount: 1, memoryMB: 512, onBuildLogs: (e) => logs.push(e.message) })
    assert.deepEqual(info.tags, ['default'])
    assert.ok(logs.join('\n').includes('This is a test file.'), logs.join('\n'))
    assert.equal(await Template.exists(name), true)

    const sb = await Sandbox.create(name, { timeoutMs: 300_000 })
    made.push(sb)
    const r = await sb.commands.run('cat /home/user/folder/other.txt; echo; readlink /home/user/folder/symlink.txt; /opt/bin/tool.sh; echo $GREETING; pwd; cat /tmp/started')
    assert.equal(r.stdout, 'other\ntest.txt\ntool\nhello\n/app\nstarted\n')

    await assert.rejects(
      Template.build(Template().fromBaseImage().runCmd('exit 7'), `${name}-bad`, { cpuCount: 1, memoryMB: 512 }),
      (e) => e.message.includes('exit code 7'),
    )
  })
})

// ownInternet makes a network namespace of the test's own, joined to the
// node by a veth, with a web server: the only host these tests reach.
function ownInternet() {
  // The Python suite runs beside this one (make test-sdks) with the same
  // fixture: it takes 10.253.1-127 and the names dsectp*, this one
  // 10.253.128-254 and dsectj*, so the two never meet.
  const tag = randomBytes(2).toString('hex')
  const ns = `dsectj-${tag}`
  const veth = `dsectj${tag}`
  const octet = 128 + (randomBytes(1)[0] % 127)
  const node = `10.253.${octet}.1`
  const web = `10.253.${octet}.2`
  const dir = mkdtempSync(join(tmpdir(), 'dsec-inet-'))
  writeFileSync(join(dir, 'index.html'), "hello from the test's own internet\n")
  const ip = (...args) => execFileSync('ip', args, { stdio: 'pipe' })
  ip('netns', 'add', ns)
  let server
  const close = () => {
    if (server) server.kill('SIGKILL')
    try { ip('link', 'del', veth) } catch {}
    try { ip('netns', 'del', ns) } catch {}
  }
  try {
    ip('link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns)
    ip('addr', 'add', `${node}/24`, 'dev', veth)
    ip('link', 'set', veth, 'up')
    ip('-n', ns, 'addr', 'add', `${web}/24`, 'dev', 'eth0')
    ip('-n', ns, 'link', 'set', 'eth0', 'up')
    ip('-n', ns, 'link', 'set', 'lo', 'up')
    ip('-n', ns, 'route', 'add', 'default', 'via', node)
    server = spawn('ip', ['netns', 'exec', ns, 'python3', '-m', 'http.server', '8080', '--bind', web, '--directory', dir], { stdio: 'ignore' })
  } catch (e) {
    close()
    throw e
  }
  return { web, url: `http://${web}:8080/index.html`, close }
}

// until resolves once host:port accepts a connection (30 s at most).
async function until(host, port) {
  const deadline = Date.now() + 30_000
  for (;;) {
    const ok = await new Promise((resolve) => {
      const s = connect({ host, port }, () => { s.destroy(); resolve(true) })
      s.on('error', () => resolve(false))
    })
    if (ok) return
    if (Date.now() > deadline) throw new Error(`nothing accepts on ${host}:${port}`)
    await new Promise((r) => setTimeout(r, 50))
  }
}

// getVia GETs / from base's address with the Host header host (a sandbox
// host the gateway serves).
function getVia(base, host) {
  const u = new URL(base)
  return new Promise((resolve, reject) => {
    const req = request({ hostname: u.hostname, port: u.port, path: '/', headers: { Host: host }, timeout: 30_000 }, (res) => {
      let body = ''
      res.setEncoding('utf8')
      res.on('data', (c) => (body += c))
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
    req.on('timeout', () => req.destroy(new Error('timed out')))
    req.end()
  })
}
