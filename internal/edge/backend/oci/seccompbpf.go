package oci

//go:generate ./gen_syscalls.sh

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"sort"
	"sync"
)

// The filter compiled here, once per process, to the classic BPF program
// the kernel takes, for crun's run.oci.seccomp_bpf_data annotation: crun
// loads it as it is, instead of compiling the OCI section with libseccomp
// at every `crun run` (measured on the same bundle: create -> first exec
// 1.09x-1.57x of an unfiltered one). Same policy as Seccomp(); runc gets the
// OCI section.
//
// Layout: the architecture must be x86-64 and the number below the x32
// range, else the process is killed; a binary tree over the sorted syscall
// numbers finds the action in about 8 comparisons (each inner node is
// "jgt K, 0, 1; ja right", so no conditional jump goes further than one
// instruction); clone, unshare and personality jump to blocks that test
// their first argument (socket too, for its family).

// seccomp_data offsets and return values (linux/seccomp.h, linux/audit.h).
const (
	offNr   = 0
	offArch = 4
	offArg0 = 16 // low 32 bits, little-endian

	auditArchX86_64 = 0xc000003e
	x32Bit          = 0x40000000

	retKillProcess = 0x80000000
	retErrno       = 0x00050000
	retAllow       = 0x7fff0000
)

// Classic BPF opcodes used (linux/bpf_common.h).
const (
	bpfLdWAbs = 0x20 // BPF_LD | BPF_W | BPF_ABS
	bpfJa     = 0x05 // BPF_JMP | BPF_JA
	bpfJeqK   = 0x15 // BPF_JMP | BPF_JEQ | BPF_K
	bpfJgtK   = 0x25 // BPF_JMP | BPF_JGT | BPF_K
	bpfJgeK   = 0x35 // BPF_JMP | BPF_JGE | BPF_K
	bpfJsetK  = 0x45 // BPF_JMP | BPF_JSET | BPF_K
	bpfRetK   = 0x06 // BPF_RET | BPF_K
)

type insn struct {
	op     uint16
	jt, jf uint8
	k      uint32
}

// verdict is what the filter does with one syscall number.
type verdict struct {
	nr    uint32
	ret   uint32 // for plain verdicts
	block string // for verdicts that look at arguments: "nsflags", "personality"
}

// seccompPolicy lists the verdict of every syscall the filter names.
func seccompPolicy() ([]verdict, error) {
	eperm, enosys := uint32(retErrno|errnoEPERM), uint32(retErrno|errnoENOSYS)
	byNr := map[uint32]verdict{}
	set := func(name string, v verdict) error {
		nr, ok := syscallNumbers[name]
		if !ok {
			return fmt.Errorf("seccomp: no x86-64 number for %q", name)
		}
		v.nr = nr
		byNr[nr] = v
		return nil
	}
	for _, group := range allowedSyscalls {
		for _, n := range group {
			if err := set(n, verdict{ret: retAllow}); err != nil {
				return nil, err
			}
		}
	}
	for _, n := range refusedSyscalls {
		if err := set(n, verdict{ret: eperm}); err != nil {
			return nil, err
		}
	}
	for _, n := range []string{"clone", "unshare"} {
		if err := set(n, verdict{block: "nsflags"}); err != nil {
			return nil, err
		}
	}
	if err := set("personality", verdict{block: "personality"}); err != nil {
		return nil, err
	}
	if err := set("socket", verdict{block: "socket"}); err != nil {
		return nil, err
	}
	if err := set("clone3", verdict{ret: enosys}); err != nil {
		return nil, err
	}
	out := make([]verdict, 0, len(byNr))
	for _, v := range byNr {
		out = append(out, v)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].nr < out[j].nr })
	return out, nil
}

// compileSeccomp builds the program.
func compileSeccomp() ([]insn, error) {
	vs, err := seccompPolicy()
	if err != nil {
		return nil, err
	}
	eperm, enosys := uint32(retErrno|errnoEPERM), uint32(retErrno|errnoENOSYS)
	var prog []insn
	emit := func(i insn) int { prog = append(prog, i); return len(prog) - 1 }
	// Architecture and ABI.
	emit(insn{op: bpfLdWAbs, k: offArch})
	emit(insn{op: bpfJeqK, k: auditArchX86_64, jt: 1, jf: 0})
	emit(insn{op: bpfRetK, k: retKillProcess})
	emit(insn{op: bpfLdWAbs, k: offNr})
	// -1 is a syscall a tracer skipped (strace --inject, rr): the kernel
	// does nothing with it, and libseccomp's filters let it through.
	emit(insn{op: bpfJeqK, k: 0xffffffff, jt: 0, jf: 1})
	emit(insn{op: bpfRetK, k: retAllow})
	emit(insn{op: bpfJgeK, k: x32Bit, jt: 0, jf: 1})
	emit(insn{op: bpfRetK, k: retKillProcess})
	// The tree; jumps to argument blocks are patched once they are placed.
	type patch struct {
		at    int
		block string
	}
	var patches []patch
	var tree func(vs []verdict)
	tree = func(vs []verdict) {
		if len(vs) <= 4 {
			for _, v := range vs {
				emit(insn{op: bpfJeqK, k: v.nr, jt: 0, jf: 1})
				if v.block != "" {
					patches = append(patches, patch{emit(insn{op: bpfJa}), v.block})
				} else {
					emit(insn{op: bpfRetK, k: v.ret})
				}
			}
			emit(insn{op: bpfRetK, k: enosys})
			return
		}
		mid := len(vs) / 2
		emit(insn{op: bpfJgtK, k: vs[mid-1].nr, jt: 0, jf: 1})
		ja := emit(insn{op: bpfJa})
		tree(vs[:mid])
		prog[ja].k = uint32(len(prog) - ja - 1)
		tree(vs[mid:])
	}
	tree(vs)
	blocks := map[string]int{}
	// clone and unshare: any namespace flag in the first argument: EPERM.
	blocks["nsflags"] = len(prog)
	var mask uint32
	for _, f := range nsFlags {
		mask |= uint32(f)
	}
	emit(insn{op: bpfLdWAbs, k: offArg0})
	emit(insn{op: bpfJsetK, k: mask, jt: 0, jf: 1})
	emit(insn{op: bpfRetK, k: eperm})
	emit(insn{op: bpfRetK, k: retAllow})
	// personality: the listed values only (the kernel reads 32 bits).
	blocks["personality"] = len(prog)
	emit(insn{op: bpfLdWAbs, k: offArg0})
	for _, p := range personalities {
		emit(insn{op: bpfJeqK, k: uint32(p), jt: 0, jf: 1})
		emit(insn{op: bpfRetK, k: retAllow})
	}
	emit(insn{op: bpfRetK, k: enosys})
	// socket: the families no network namespace scopes get EAFNOSUPPORT.
	blocks["socket"] = len(prog)
	emit(insn{op: bpfLdWAbs, k: offArg0})
	for _, f := range refusedFamilies {
		emit(insn{op: bpfJeqK, k: uint32(f), jt: 0, jf: 1})
		emit(insn{op: bpfRetK, k: retErrno | errnoEAFNOSUPPORT})
	}
	emit(insn{op: bpfRetK, k: retAllow})
	for _, p := range patches {
		prog[p.at].k = uint32(blocks[p.block] - p.at - 1)
	}
	if len(prog) > 4096 {
		return nil, fmt.Errorf("seccomp: program of %d instructions; the kernel takes 4096", len(prog))
	}
	return prog, nil
}

var (
	bpfOnce sync.Once
	bpfB64  string
	bpfErr  error
)

// SeccompBPF returns the compiled filter, base64-encoded as crun's
// run.oci.seccomp_bpf_data annotation wants it.
func SeccompBPF() (string, error) {
	bpfOnce.Do(func() {
		prog, err := compileSeccomp()
		if err != nil {
			bpfErr = err
			return
		}
		raw := make([]byte, 0, 8*len(prog))
		for _, i := range prog {
			raw = binary.LittleEndian.AppendUint16(raw, i.op)
			raw = append(raw, i.jt, i.jf)
			raw = binary.LittleEndian.AppendUint32(raw, i.k)
		}
		bpfB64 = base64.StdEncoding.EncodeToString(raw)
	})
	return bpfB64, bpfErr
}
