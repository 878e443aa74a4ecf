package oci

import (
	"encoding/base64"
	"encoding/binary"
	"testing"
)

// run interprets the program the way the kernel does, for the subset of
// classic BPF it uses.
func run(t *testing.T, prog []insn, arch, nr, arg0 uint32) uint32 {
	t.Helper()
	var a uint32
	for pc, steps := 0, 0; pc < len(prog); pc, steps = pc+1, steps+1 {
		if steps > len(prog) {
			t.Fatal("the program loops")
		}
		i := prog[pc]
		switch i.op {
		case bpfLdWAbs:
			a = map[uint32]uint32{offNr: nr, offArch: arch, offArg0: arg0}[i.k]
		case bpfJa:
			pc += int(i.k)
		case bpfJeqK, bpfJgtK, bpfJgeK, bpfJsetK:
			ok := map[uint16]bool{bpfJeqK: a == i.k, bpfJgtK: a > i.k, bpfJgeK: a >= i.k, bpfJsetK: a&i.k != 0}[i.op]
			if ok {
				pc += int(i.jt)
			} else {
				pc += int(i.jf)
			}
		case bpfRetK:
			return i.k
		default:
			t.Fatalf("instruction %d: unknown opcode %#x", pc, i.op)
		}
	}
	t.Fatal("the program ran off its end")
	return 0
}

// The compiled program gives every syscall the verdict the policy (and the
// OCI section runc gets) gives it.
func TestCompiledFilterMatchesThePolicy(t *testing.T) {
	prog, err := compileSeccomp()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d instructions", len(prog))
	allowed, refused := map[uint32]bool{}, map[uint32]bool{}
	for _, g := range allowedSyscalls {
		for _, n := range g {
			allowed[syscallNumbers[n]] = true
		}
	}
	for _, n := range refusedSyscalls {
		refused[syscallNumbers[n]] = true
		delete(allowed, syscallNumbers[n])
	}
	eperm, enosys := uint32(retErrno|errnoEPERM), uint32(retErrno|errnoENOSYS)
	special := map[uint32]bool{syscallNumbers["clone"]: true, syscallNumbers["unshare"]: true, syscallNumbers["personality"]: true, syscallNumbers["clone3"]: true, syscallNumbers["socket"]: true}
	for nr := uint32(0); nr < 600; nr++ {
		if special[nr] {
			continue
		}
		want := enosys
		switch {
		case refused[nr]:
			want = eperm
		case allowed[nr]:
			want = retAllow
		}
		if got := run(t, prog, auditArchX86_64, nr, 0); got != want {
			t.Errorf("syscall %d: %#x, want %#x", nr, got, want)
		}
	}
	for _, name := range []string{"clone", "unshare"} {
		nr := syscallNumbers[name]
		if got := run(t, prog, auditArchX86_64, nr, 0x11 /* SIGCHLD */ |0x100 /* CLONE_VM */); got != retAllow {
			t.Errorf("%s without namespace flags: %#x", name, got)
		}
		for _, f := range nsFlags {
			if got := run(t, prog, auditArchX86_64, nr, uint32(f)|0x11); got != eperm {
				t.Errorf("%s with flag %#x: %#x, want EPERM", name, f, got)
			}
		}
	}
	if got := run(t, prog, auditArchX86_64, syscallNumbers["clone3"], 0); got != enosys {
		t.Errorf("clone3: %#x", got)
	}
	for _, p := range personalities {
		if got := run(t, prog, auditArchX86_64, syscallNumbers["personality"], uint32(p)); got != retAllow {
			t.Errorf("personality(%#x): %#x", p, got)
		}
	}
	if got := run(t, prog, auditArchX86_64, syscallNumbers["personality"], 0x1234); got != enosys {
		t.Errorf("personality(0x1234): %#x", got)
	}
	for fam := uint32(0); fam < 50; fam++ {
		want := uint32(retAllow)
		if fam == 38 || fam == 40 {
			want = retErrno | errnoEAFNOSUPPORT
		}
		if got := run(t, prog, auditArchX86_64, syscallNumbers["socket"], fam); got != want {
			t.Errorf("socket(%d): %#x, want %#x", fam, got, want)
		}
	}
	if got := run(t, prog, auditArchX86_64, 0xffffffff, 0); got != retAllow {
		t.Errorf("syscall -1 (skipped by a tracer): %#x", got)
	}
	if got := run(t, prog, 0x40000003 /* i386 */, 1, 0); got != retKillProcess {
		t.Errorf("i386 ABI: %#x", got)
	}
	if got := run(t, prog, auditArchX86_64, x32Bit|1, 0); got != retKillProcess {
		t.Errorf("x32 ABI: %#x", got)
	}
	// Every jump lands inside the program.
	for pc, i := range prog {
		if (i.op == bpfJa && pc+1+int(i.k) >= len(prog)) || pc+1+int(i.jt) >= len(prog) || pc+1+int(i.jf) >= len(prog) {
			if i.op != bpfRetK {
				t.Fatalf("instruction %d jumps out of the program", pc)
			}
		}
	}
}

func TestSeccompBPFEncoding(t *testing.T) {
	b64, err := SeccompBPF()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(raw)%8 != 0 {
		t.Fatalf("%d bytes, %v", len(raw), err)
	}
	prog, _ := compileSeccomp()
	if binary.LittleEndian.Uint16(raw[0:]) != prog[0].op || binary.LittleEndian.Uint32(raw[4:]) != prog[0].k {
		t.Fatal("encoding differs from the program")
	}
}
