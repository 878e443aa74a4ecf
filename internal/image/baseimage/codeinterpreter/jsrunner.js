// OpenDsec's JavaScript runner [ours], driven by jskernel.py: it reads one
// JSON line per cell ({"code": ...}) on stdin and answers on the file
// descriptor $DSEC_JS_MESSAGE_FD (default 3), one JSON
// line per message: {"type": "stream", "name": "stdout"|"stderr", "text"},
// {"type": "result", "text"}, {"type": "error", "ename", "evalue",
// "traceback"}, then {"type": "done"}. Cells run in this process's global
// scope, so what one defines the next sees; SIGINT stops a running cell and
// keeps that scope. Node's standard library only.
'use strict'

const fs = require('fs')
const readline = require('readline')
const util = require('util')
const vm = require('vm')

const out = fs.createWriteStream(null, { fd: Number(process.env.DSEC_JS_MESSAGE_FD || 3) })
delete process.env.DSEC_JS_MESSAGE_FD
let current = null // the id of the cell running, or that ran last
const send = (msg) => out.write(JSON.stringify({ ...msg, id: current }) + '\n')

// What the cell prints is sent in order with its other messages.
for (const name of ['stdout', 'stderr']) {
  process[name].write = (chunk, encoding, cb) => {
    send({ type: 'stream', name, text: typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString('utf8') })
    if (typeof encoding === 'function') encoding()
    else if (typeof cb === 'function') cb()
    return true
  }
}
globalThis.require = require
globalThis.module = module

// An error thrown later (a timer's, a promise nobody awaited) is printed,
// not fatal: the scope outlives it.
const report = (err) => send({ type: 'stream', name: 'stderr', text: ((err && err.stack) || String(err)) + '\n' })
process.on('uncaughtException', report)
process.on('unhandledRejection', report)

// SIGINT while no cell runs is ignored; while one runs, breakOnSigint
// turns it into an error inside the cell.
process.on('SIGINT', () => {})

// A traceback shows the cell's frames, not the runner's.
const ownFrame = /node:vm|node:internal|jsrunner\.js/

function errorMessage(err) {
  if (err instanceof Error) {
    const lines = (err.stack || String(err)).split('\n').filter((l) => !ownFrame.test(l))
    return { type: 'error', ename: err.name || 'Error', evalue: err.message || String(err), traceback: lines }
  }
  return { type: 'error', ename: 'Error', evalue: util.inspect(err), traceback: ['Uncaught ' + util.inspect(err)] }
}

const statementStart = /^((const|let|var|function|class|if|for|while|do|switch|try|return|throw|import|export|break|continue)\b|[}{)\]])/

function withReturn(code) {
  const lines = code.replace(/\s+$/, '').split('\n')
  const last = lines[lines.length - 1].trim()
  if (last && !statementStart.test(last) && !last.endsWith('{') && !last.startsWith('//')) {
    lines[lines.length - 1] = 'return (' + last.replace(/;$/, '') + ')'
  }
  return lines.join('\n')
}

// Static imports (`import { readFileSync } from 'fs'`) are not allowed in
// a script; a cell's are made requires of the same names, declared with
// var so that later cells see them, as E2B's kernel keeps them. What the
// module exports is taken as CommonJS gives it (Node.js builtins and
// CommonJS packages; a package that is only an ES module cannot be
// loaded, as dynamic import() is not available to a cell either).
const importFrom = /^[ \t]*import\s+(?![(\s])?([^'"`;]*?)\s+from\s*(['"])([^'"]+)\2[ \t]*;?/gm
const importBare = /^[ \t]*import\s*(['"])([^'"]+)\1[ \t]*;?/gm

function bindings(clause, mod) {
  const out = []
  const ns = /^\*\s+as\s+([\w$]+)$/
  let rest = clause.trim()
  const dflt = /^([\w$]+)\s*(,|$)/.exec(rest)
  if (dflt) {
    out.push(`var ${dflt[1]} = __dsecDefault(${mod});`)
    rest = rest.slice(dflt[0].length).trim()
  }
  if (ns.test(rest)) {
    out.push(`var ${ns.exec(rest)[1]} = ${mod};`)
  } else if (rest.startsWith('{') && rest.endsWith('}')) {
    const names = rest.slice(1, -1).split(',').map((n) => n.trim()).filter(Boolean)
    out.push('var { ' + names.map((n) => n.replace(/^([\w$]+)\s+as\s+([\w$]+)$/, '$1: $2')).join(', ') + ` } = ${mod};`)
  } else if (rest !== '') {
    return null // not an import this runner understands: left for Node.js to refuse
  }
  return out.join(' ')
}

globalThis.__dsecDefault = (m) => (m && m.__esModule && 'default' in m ? m.default : m)

function esmImports(code) {
  return code
    .replace(importFrom, (all, clause, q, name) => {
      const made = bindings(clause, `require(${JSON.stringify(name)})`)
      return made === null ? all : made
    })
    .replace(importBare, (all, q, name) => `require(${JSON.stringify(name)});`)
}

// The TypeScript kernel's runner: a cell's types are removed with the
// TypeScript compiler (Debian's node-typescript), without type checking,
// as ts-node's transpile-only mode does; the JavaScript it gives runs as
// any cell.
const typescript = process.env.DSEC_JS_TYPESCRIPT === '1' ? require('typescript') : null
delete process.env.DSEC_JS_TYPESCRIPT

function transpiled(code) {
  if (!typescript) return code
  const out = typescript.transpileModule(code, {
    compilerOptions: { target: typescript.ScriptTarget.ES2022, module: typescript.ModuleKind.ESNext, removeComments: false },
    reportDiagnostics: false,
  })
  return out.outputText.replace(/^export \{\};\s*$/m, '')
}

async function runCell(code) {
  code = esmImports(transpiled(code))
  let value
  try {
    value = vm.runInThisContext(code, { filename: 'cell', breakOnSigint: true })
  } catch (err) {
    // `await` at the top level: the cell runs as the body of an async
    // function (its declarations are its own; assign to globalThis to keep
    // one), and a last line that is an expression is what it answers.
    if (err instanceof SyntaxError && /await/.test(err.message)) {
      value = vm.runInThisContext('(async () => {\n' + withReturn(code) + '\n})()', { filename: 'cell', breakOnSigint: true })
    } else {
      throw err
    }
  }
  if (value && typeof value.then === 'function') value = await value
  return value
}

const lines = readline.createInterface({ input: process.stdin, terminal: false })
let queue = Promise.resolve()
lines.on('line', (line) => {
  queue = queue.then(async () => {
    let cell
    try {
      cell = JSON.parse(line)
    } catch (err) {
      send(errorMessage(err))
      return
    }
    // Every message of the cell names it: what an interrupted cell sends
    // late is not taken for the next one's.
    current = cell.id
    try {
      const value = await runCell(String(cell.code))
      if (value !== undefined) send({ type: 'result', text: typeof value === 'string' ? util.inspect(value) : util.inspect(value, { depth: 4 }) })
    } catch (err) {
      send(errorMessage(err))
    }
    send({ type: 'done' })
  })
})
lines.on('close', () => process.exit(0))
