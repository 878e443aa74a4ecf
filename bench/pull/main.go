// Command pull benchmarks pulls and pushes against skopeo, the raw tool of
// the registry protocol, in one run on one registry: Debian's
// docker-registry on loopback, holding an image of -size MiB in -layers
// incompressible layers. Each round pulls the image into a new, empty
// image store with our registry package (what `dsec image pull` runs in
// the apiserver) and with `skopeo copy docker://... oci:DIR`, and pushes it
// to a new repository with ours and with `skopeo copy oci:DIR docker://...`;
// it prints each median and the ratios. Needs docker-registry and skopeo.
package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/registry"
)

func main() {
	size := flag.Int("size", 512, "image size in MiB")
	layers := flag.Int("layers", 4, "layers")
	rounds := flag.Int("rounds", 3, "rounds (each: a pull and a push with each tool)")
	flag.Parse()
	if err := run(context.Background(), *size, *layers, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, sizeMiB, layers, rounds int) error {
	work, err := os.MkdirTemp("", "dsec-bench-pull-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	host, stop, err := startRegistry(work)
	if err != nil {
		return err
	}
	defer stop()
	layout := filepath.Join(work, "layout")
	t0 := time.Now()
	if err := writeLayout(layout, sizeMiB, layers); err != nil {
		return err
	}
	fmt.Printf("image: %d MiB in %d layers (written in %s); registry %s\n", sizeMiB, layers, time.Since(t0).Round(time.Millisecond), host)
	if err := skopeo("copy", "oci:"+layout+":bench", "docker://"+host+"/bench/src:1"); err != nil {
		return err
	}
	src := host + "/bench/src:1"
	as, _ := image.ParseRef("root/bench:1")
	var ours, theirs, oursPush, theirsPush []time.Duration
	for i := 0; i < rounds; i++ {
		storeDir := filepath.Join(work, fmt.Sprintf("store-%d", i))
		store, err := image.OpenStore(storeDir)
		if err != nil {
			return err
		}
		start := time.Now()
		im, err := registry.Pull(ctx, store, src, as, registry.Options{})
		if err != nil {
			return fmt.Errorf("our pull: %w", err)
		}
		ours = append(ours, time.Since(start))

		dir := filepath.Join(work, fmt.Sprintf("skopeo-%d", i))
		start = time.Now()
		if err := skopeo("copy", "docker://"+src, "oci:"+dir+":bench"); err != nil {
			return err
		}
		theirs = append(theirs, time.Since(start))

		// Pushes go to empty registries: one that holds the blobs would
		// let a pusher skip or mount them.
		for _, who := range []string{"ours", "skopeo"} {
			dst, stopDst, err := startRegistry(filepath.Join(work, fmt.Sprintf("push-%s-%d", who, i)))
			if err != nil {
				return err
			}
			start = time.Now()
			if who == "ours" {
				_, err = registry.Push(ctx, store, im, dst+"/bench/pushed:1", registry.Options{})
				oursPush = append(oursPush, time.Since(start))
			} else {
				err = skopeo("copy", "oci:"+dir+":bench", "docker://"+dst+"/bench/pushed:1")
				theirsPush = append(theirsPush, time.Since(start))
			}
			stopDst()
			os.RemoveAll(filepath.Join(work, fmt.Sprintf("push-%s-%d", who, i)))
			if err != nil {
				return fmt.Errorf("%s push: %w", who, err)
			}
		}
		os.RemoveAll(storeDir)
		os.RemoveAll(dir)
		fmt.Printf("round %d: pull ours %s skopeo %s; push ours %s skopeo %s\n", i+1, ms(ours[i]), ms(theirs[i]), ms(oursPush[i]), ms(theirsPush[i]))
	}
	p, q := median(ours), median(theirs)
	fmt.Printf("pull %d MiB: ours %s  skopeo copy %s  ratio %.2f  (ours %.0f MiB/s)\n", sizeMiB, ms(p), ms(q), p.Seconds()/q.Seconds(), float64(sizeMiB)/p.Seconds())
	p, q = median(oursPush), median(theirsPush)
	fmt.Printf("push %d MiB: ours %s  skopeo copy %s  ratio %.2f\n", sizeMiB, ms(p), ms(q), p.Seconds()/q.Seconds())
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0fms", float64(d.Microseconds())/1000) }

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func skopeo(args ...string) error {
	full := append([]string{args[0], "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"}, args[1:]...)
	cmd := exec.Command("skopeo", full...)
	// A HOME of its own per run: skopeo's blob-info cache would otherwise
	// tell it where blobs already are, which ours does not keep.
	home, err := os.MkdirTemp("", "dsec-bench-skopeo-home-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(home)
	cmd.Env = append(os.Environ(), "HOME="+home)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("skopeo %v: %v\n%s", full, err, out)
	}
	return nil
}

func startRegistry(work string) (string, func(), error) {
	if err := os.MkdirAll(work, 0o755); err != nil {
		return "", nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	host := l.Addr().String()
	l.Close()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n", filepath.Join(work, "registry"), host)
	path := filepath.Join(work, "registry.yml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return "", nil, err
	}
	cmd := exec.Command("docker-registry", "serve", path)
	if err := cmd.Start(); err != nil {
		return "", nil, fmt.Errorf("docker-registry (apt install docker-registry): %w", err)
	}
	stop := func() { cmd.Process.Kill(); cmd.Wait() }
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := http.Get("http://" + host + "/v2/"); err == nil {
			resp.Body.Close()
			return host, stop, nil
		}
		if time.Now().After(deadline) {
			stop()
			return "", nil, fmt.Errorf("docker-registry on %s did not answer", host)
		}
	}
}

// writeLayout writes an OCI layout "bench": layers of one file of noise
// each, gzip without compression (noise does not compress; a pull moves
// the bytes either way).
func writeLayout(dir string, sizeMiB, layers int) error {
	blobs := filepath.Join(dir, "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o755); err != nil {
		return err
	}
	put := func(data []byte, mt string) ocispec.Descriptor {
		d := digest.FromBytes(data)
		os.WriteFile(filepath.Join(blobs, d.Encoded()), data, 0o644)
		return ocispec.Descriptor{MediaType: mt, Digest: d, Size: int64(len(data))}
	}
	r := rand.New(rand.NewPCG(1, 2))
	var descs []ocispec.Descriptor
	var diffIDs []digest.Digest
	per := sizeMiB << 20 / layers
	for i := 0; i < layers; i++ {
		noise := make([]byte, per)
		for j := 0; j+8 <= len(noise); j += 8 {
			v := r.Uint64()
			for k := 0; k < 8; k++ {
				noise[j+k] = byte(v >> (8 * k))
			}
		}
		var raw bytes.Buffer
		tw := tar.NewWriter(&raw)
		tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("data/%d", i), Mode: 0o644, Size: int64(len(noise)), ModTime: time.Unix(1700000000, 0)})
		tw.Write(noise)
		tw.Close()
		diffIDs = append(diffIDs, digest.FromBytes(raw.Bytes()))
		var gz bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&gz, gzip.NoCompression)
		io.Copy(zw, &raw)
		zw.Close()
		descs = append(descs, put(gz.Bytes(), ocispec.MediaTypeImageLayerGzip))
	}
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"}, RootFS: ocispec.RootFS{Type: "layers", DiffIDs: diffIDs}})
	m, _ := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, Config: put(cfg, ocispec.MediaTypeImageConfig), Layers: descs})
	md := put(m, ocispec.MediaTypeImageManifest)
	md.Annotations = map[string]string{ocispec.AnnotationRefName: "bench"}
	idx, _ := json.Marshal(ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{md}})
	if err := os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, ocispec.ImageLayoutFile), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
}
