// Package rpcopts holds the Connect options every OpenDsec server shares.
package rpcopts

import "connectrpc.com/connect"

// CompressMinBytes is the smallest message a server gzips. Connect's
// default is to compress every message when the peer accepts gzip; on the
// loopback and Unix-socket hops of a node that spends CPU (flate's setup
// showed in the profile of every exec round trip) to save nothing, so only
// messages large enough for compression to pay (file reads, big outputs)
// are compressed.
const CompressMinBytes = 64 << 10

// Handler returns the options for a Connect handler, followed by extra.
func Handler(extra ...connect.HandlerOption) []connect.HandlerOption {
	return append([]connect.HandlerOption{connect.WithCompressMinBytes(CompressMinBytes)}, extra...)
}
