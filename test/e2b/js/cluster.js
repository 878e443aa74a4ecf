// Starts `bin/dsec up` for the suite (unless E2B_API_URL is set) and points
// E2B's SDK at its gateway with the three variables a user would change.
import { spawn, spawnSync } from 'node:child_process'
import { test } from 'node:test'
import { existsSync, mkdtempSync, openSync, readFileSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..', '..')

// freePort finds a free port below the kernel's ephemeral range (32768 and
// up): a port the kernel handed out and we closed could go to one of dsec
// up's own ":0" listeners before dsec up binds to it.
function tryPort(port) {
  return new Promise((ok) => {
    const s = createServer()
    s.once('error', () => ok(false))
    s.listen(port, '127.0.0.1', () => s.close(() => ok(true)))
  })
}

async function freePort() {
  for (let i = 0; i < 100; i++) {
    const port = 20000 + Math.floor(Math.random() * 12000)
    if (await tryPort(port)) return port
  }
  throw new Error('no free port in 20000-31999')
}

function readEnv(path) {
  const env = {}
  for (const line of readFileSync(path, 'utf8').split('\n')) {
    const m = /^export ([A-Z0-9_]+)=(.*)$/.exec(line)
    if (m) env[m[1]] = m[2]
  }
  return env
}

// missing returns { skip } with the reason; in a strict run
// (DSEC_TEST_STRICT=1, which make test sets) it throws instead, so a
// missing runtime or image fails the suite rather than skipping it.
function missing(reason) {
  if (process.env.DSEC_TEST_STRICT === '1') throw new Error(`${reason} (DSEC_TEST_STRICT=1: missing runtimes fail the run)`)
  return { skip: reason }
}

// start returns { skip } with a reason, or { env, stop }.
export async function start() {
  if (process.env.E2B_API_URL) return { env: process.env, stop: async () => {} }
  if (process.getuid() !== 0) return missing('the gvisor backend needs root')
  const dsec = join(repo, 'bin', 'dsec')
  if (!existsSync(dsec)) return missing('bin/dsec not built (make build)')
  const images = process.env.DSEC_TEST_IMAGE_STORE || join(repo, '.cache', 'images')
  if (!existsSync(join(images, 'refs', 'root', 'py', '3.11'))) return missing('root/py:3.11 not built (make images)')

  const state = mkdtempSync(join(tmpdir(), 'dsec-e2b-js-'))
  const log = openSync(join(state, 'dsec.log'), 'w')
  const proc = spawn(
    dsec,
    ['up', '--state-dir', state, '--listen', `127.0.0.1:${await freePort()}`, '--e2b-listen', `127.0.0.1:${await freePort()}`, '--image-store', images],
    { stdio: ['ignore', log, log] },
  )
  const envFile = join(state, 'client.env')
  const deadline = Date.now() + 30_000
  while (!existsSync(envFile)) {
    if (proc.exitCode !== null || Date.now() > deadline) {
      throw new Error('dsec up did not start: ' + readFileSync(join(state, 'dsec.log'), 'utf8'))
    }
    await new Promise((r) => setTimeout(r, 50))
  }
  const env = readEnv(envFile)
  for (const k of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) process.env[k] = env[k]
  return {
    env,
    // stop removes the sandboxes, stops the cluster and removes its state
    // (the node's unpacked image layers: hundreds of MB), which is kept
    // after a failing run or with DSEC_KEEP_TEST_STATE set.
    stop: async ({ keepState = false } = {}) => {
      spawnSync(dsec, ['stop', '--all'], { env: { ...process.env, ...env } })
      const exited = new Promise((r) => proc.once('exit', r))
      proc.kill('SIGTERM')
      await exited
      if (keepState || process.env.DSEC_KEEP_TEST_STATE) console.log(`dsec state kept in ${state}`)
      else rmSync(state, { recursive: true, force: true })
    },
  }
}

// guardedTest returns the suite's `it`: a test skipped while state.cluster
// says why it could not start, and marking state.failed when it fails (the
// cluster's state is then kept for a look).
export function guardedTest(state) {
  return (name, fn) =>
    test(name, async (t) => {
      if (state.cluster.skip) return t.skip(state.cluster.skip)
      try {
        await fn(t)
      } catch (e) {
        state.failed = true
        throw e
      }
    })
}
