// E2B's Code Interpreter SDK for JavaScript (@e2b/code-interpreter, pinned in
// package.json), unchanged, against the gateway: the template
// code-interpreter-v1 is OpenDsec's image root/code-interpreter.
import assert from 'node:assert/strict'
import { existsSync } from 'node:fs'
import { join, resolve, dirname } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, before, describe } from 'node:test'

import { Sandbox } from '@e2b/code-interpreter'

import { guardedTest, start } from './cluster.js'

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..', '..')

describe('E2B Code Interpreter JavaScript SDK through the OpenDsec gateway', () => {
  const state = { cluster: null, failed: false }
  let sb
  before(async () => {
    const images = process.env.DSEC_TEST_IMAGE_STORE || join(repo, '.cache', 'images')
    if (!existsSync(join(images, 'refs', 'root', 'code-interpreter', 'latest'))) {
      const reason = 'root/code-interpreter is not built (make images)'
      if (process.env.DSEC_TEST_STRICT === '1') throw new Error(`${reason} (DSEC_TEST_STRICT=1: missing images fail the run)`)
      state.cluster = { skip: reason }
      return
    }
    state.cluster = await start()
    if (!state.cluster.skip) sb = await Sandbox.create({ timeoutMs: 600_000 })
  })
  after(async () => {
    await sb?.kill().catch(() => {})
    if (state.cluster?.stop) await state.cluster.stop({ keepState: state.failed })
  })
  const it = guardedTest(state)

  it('cells share state and stream output', async () => {
    const seen = []
    const first = await sb.runCode('x = 41\nprint("hello")\nx + 1', { onStdout: (m) => seen.push(m.line) })
    assert.equal(first.error, undefined)
    assert.equal(first.text, '42')
    assert.deepEqual(first.logs.stdout, ['hello\n'])
    assert.deepEqual(seen, ['hello\n'])
    assert.equal((await sb.runCode('x * 2')).text, '82')
  })

  it('a matplotlib chart comes back as a PNG', async () => {
    const ex = await sb.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()')
    assert.equal(ex.error, undefined)
    const pngs = ex.results.filter((r) => r.png).map((r) => Buffer.from(r.png, 'base64'))
    assert.equal(pngs.length, 1)
    assert.deepEqual([...pngs[0].subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
  })

  it('an exception is an error with its traceback', async () => {
    const ex = await sb.runCode('def f():\n    raise ValueError("boom")\nf()')
    assert.equal(ex.error.name, 'ValueError')
    assert.equal(ex.error.value, 'boom')
    // IPython's traceback, colours and all, as E2B answers it.
    const plain = ex.error.traceback.replace(/\x1b\[[0-9;]*m/g, '')
    assert.match(plain, /raise ValueError\("boom"\)/)
  })

  it('a cell that never ends is cut by its timeout, and the kernel goes on', async () => {
    await sb.runCode('kept = "still here"')
    await assert.rejects(sb.runCode('import time\nwhile True:\n    time.sleep(0.1)', { timeoutMs: 3000 }), (e) => {
      assert.match(e.message, /Execution timed out/)
      return true
    })
    const started = Date.now()
    assert.equal((await sb.runCode('kept')).text, 'still here')
    assert.ok(Date.now() - started < 10_000, 'the interrupted cell still held the kernel')
  })

  it('runs JavaScript cells that share state', async () => {
    const first = await sb.runCode('const base = 40\nconsole.log("from node")\nbase + 2', { language: 'js' })
    assert.equal(first.error, undefined)
    assert.equal(first.text, '42')
    assert.deepEqual(first.logs.stdout, ['from node\n'])
    assert.equal((await sb.runCode('base * 2', { language: 'js' })).text, '80')
    const err = (await sb.runCode('null.x', { language: 'js' })).error
    assert.equal(err.name, 'TypeError')
  })

  it('a bash context keeps its own state', async () => {
    const ctx = await sb.createCodeContext({ language: 'bash' })
    assert.equal(ctx.language, 'bash')
    await sb.runCode('N=7', { context: ctx })
    assert.deepEqual((await sb.runCode('echo $((N * 6))', { context: ctx })).logs.stdout, ['42\n'])
    assert.ok((await sb.listCodeContexts()).some((c) => c.id === ctx.id))
    await sb.removeCodeContext(ctx)
    assert.ok(!(await sb.listCodeContexts()).some((c) => c.id === ctx.id))
  })

  it('a string result reads without its quotes, as E2B answers it', async () => {
    assert.equal((await sb.runCode("'supertest'")).text, 'supertest')
    assert.equal((await sb.runCode("'supertest'", { language: 'js' })).text, 'supertest')
    assert.equal((await sb.runCode("['a']")).text, "['a']")
  })

  it('has default Python and JavaScript contexts, run as root in /home/user', async () => {
    const languages = (await sb.listCodeContexts()).map((c) => c.language)
    assert.ok(languages.includes('python') && languages.includes('javascript'), languages.join(','))
    assert.equal((await sb.runCode('process.cwd()', { language: 'js' })).text, '/home/user')
    const ctx = await sb.createCodeContext({ cwd: '/root' })
    assert.equal((await sb.runCode('import os; os.getcwd()', { context: ctx })).text, '/root')
    await sb.removeCodeContext(ctx)
  })

  it('a cell of a sandbox killed under it says so, at once', async () => {
    const victim = await Sandbox.create({ timeoutMs: 120_000 })
    const timer = setTimeout(() => victim.kill().catch(() => {}), 2000)
    const started = Date.now()
    try {
      await assert.rejects(victim.runCode('import time; time.sleep(60)'), (e) => {
        assert.match(e.message, /sandbox was killed while the request was in progress/)
        return true
      })
      assert.ok(Date.now() - started < 30_000, `the cut took ${Date.now() - started} ms`)
    } finally {
      clearTimeout(timer)
      await victim.kill().catch(() => {})
    }
  })
})
