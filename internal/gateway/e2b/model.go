package e2b

import (
	"math"
	"strings"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// templateKey is the metadata entry that remembers the E2B template a
// sandbox was created from; it is hidden from E2B's metadata, as is every
// "e2b." entry.
const templateKey = "e2b.templateID"

// idempotencyKey remembers the Idempotency-Key a sandbox was created with.
const idempotencyKey = "e2b.idempotencyKey"

// sandboxJSON is E2B's Sandbox: what create, connect, resume and fork return.
type sandboxJSON struct {
	TemplateID      string  `json:"templateID"`
	SandboxID       string  `json:"sandboxID"`
	Alias           string  `json:"alias,omitempty"`
	ClientID        string  `json:"clientID"`
	EnvdVersion     string  `json:"envdVersion"`
	EnvdAccessToken string  `json:"envdAccessToken,omitempty"`
	Domain          *string `json:"domain"`
	// TrafficAccessToken opens the sandbox's hosts when it does not allow
	// public traffic.
	TrafficAccessToken string `json:"trafficAccessToken,omitempty"`
}

// detailJSON is E2B's SandboxDetail and ListedSandbox.
type detailJSON struct {
	TemplateID      string            `json:"templateID"`
	SandboxID       string            `json:"sandboxID"`
	Alias           string            `json:"alias,omitempty"`
	ClientID        string            `json:"clientID"`
	StartedAt       string            `json:"startedAt"`
	EndAt           string            `json:"endAt"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken,omitempty"`
	CPUCount        int               `json:"cpuCount"`
	MemoryMB        int64             `json:"memoryMB"`
	DiskSizeMB      int64             `json:"diskSizeMB"`
	State           string            `json:"state"`
	Metadata        map[string]string `json:"metadata"`
	Domain          *string           `json:"domain"`
	Lifecycle       *lifecycleJSON    `json:"lifecycle,omitempty"`
}

// newSandboxJSON is E2B's NewSandbox / NewSandboxV2 request.
type newSandboxJSON struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	AutoPause           *bool             `json:"autoPause"`
	AutoResume          *autoResumeJSON   `json:"autoResume"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	IAM                 any               `json:"iam"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkJSON      `json:"network"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	MCP                 any               `json:"mcp"`
	VolumeMounts        []any             `json:"volumeMounts"`
}

// autoResumeJSON is E2B's SandboxAutoResumeConfig: older SDKs send
// enabled, newer ones policy ("any" or "off").
type autoResumeJSON struct {
	Enabled *bool  `json:"enabled"`
	Policy  string `json:"policy"`
}

// resumesOnCall says whether calls to the sandbox resume it while paused
// (E2B's default: they do).
func (a *autoResumeJSON) resumesOnCall() (bool, error) {
	if a == nil {
		return true, nil
	}
	switch a.Policy {
	case "", "any", "off":
	default:
		return false, errdefs.InvalidArgument("autoResume.policy %q: want \"any\" or \"off\"", a.Policy)
	}
	if a.Enabled != nil && a.Policy != "" && *a.Enabled != (a.Policy == "any") {
		return false, errdefs.InvalidArgument("autoResume: enabled %t and policy %q disagree", *a.Enabled, a.Policy)
	}
	if a.Policy != "" {
		return a.Policy == "any", nil
	}
	return a.Enabled == nil || *a.Enabled, nil
}

// lifecycleJSON is E2B's SandboxLifecycle, in a sandbox's details.
type lifecycleJSON struct {
	AutoResume bool   `json:"autoResume"`
	OnTimeout  string `json:"onTimeout"`
}

// defaultTimeout is E2B's default time to live, in seconds.
const defaultTimeout = 300

func (g *Gateway) toSandbox(sb *sandboxv1.Sandbox) sandboxJSON {
	out := sandboxJSON{
		TemplateID: templateOf(sb), SandboxID: sb.Id, ClientID: clientID,
		EnvdVersion: EnvdVersion, EnvdAccessToken: g.accessToken(sb.Id),
	}
	if g.cfg.Domain != "" {
		out.Domain = &g.cfg.Domain
	}
	if n := sb.Spec.GetNetwork(); n != nil && !n.AllowPublicTraffic {
		out.TrafficAccessToken = g.trafficToken(sb.Id)
	}
	return out
}

func (g *Gateway) toDetail(sb *sandboxv1.Sandbox, withToken bool) detailJSON {
	d := detailJSON{
		TemplateID: templateOf(sb), SandboxID: sb.Id, ClientID: clientID,
		StartedAt: sb.CreatedAt.AsTime().UTC().Format(time.RFC3339Nano), EndAt: sb.ExpiresAt.AsTime().UTC().Format(time.RFC3339Nano),
		EnvdVersion: EnvdVersion,
		CPUCount:    int(math.Ceil(sb.Spec.GetResources().GetCpuCores())),
		MemoryMB:    sb.Spec.GetResources().GetMemoryMb(),
		DiskSizeMB:  sb.Spec.GetResources().GetDiskMb(),
		State:       "running",
		Metadata:    userMetadata(sb.Spec.GetMetadata()),
	}
	if sb.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		d.State = "paused"
	}
	d.Lifecycle = &lifecycleJSON{OnTimeout: "kill"}
	if sb.Spec.GetOnTimeout() == sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE {
		d.Lifecycle = &lifecycleJSON{OnTimeout: "pause", AutoResume: !sb.Spec.GetExplicitResume()}
	}
	if withToken {
		d.EnvdAccessToken = g.accessToken(sb.Id)
	}
	if g.cfg.Domain != "" {
		d.Domain = &g.cfg.Domain
	}
	return d
}

func templateOf(sb *sandboxv1.Sandbox) string {
	if t := sb.Spec.GetMetadata()[templateKey]; t != "" {
		return t
	}
	return sb.Spec.GetImage()
}

// userMetadata drops the gateway's own entries.
func userMetadata(md map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range md {
		if !strings.HasPrefix(k, "e2b.") {
			out[k] = v
		}
	}
	return out
}

// codeInterpreterTemplate is the template E2B's Code Interpreter SDKs
// create by default. Its server is reached on a port, so a sandbox of it
// gets a network even when the create asks for none.
const codeInterpreterTemplate = "code-interpreter-v1"

// imageFor maps an E2B template id to our image name: "base" is the
// configured base image, "code-interpreter-v1" the code interpreter's; a name with a slash is one of our image names; any
// other name is root/<name>:latest.
func (g *Gateway) imageFor(template string) (string, error) {
	switch {
	case template == "":
		return "", errdefs.InvalidArgument("templateID: required")
	case template == "base":
		return g.cfg.BaseImage, nil
	case template == codeInterpreterTemplate:
		return g.cfg.CodeInterpreterImage, nil
	case strings.Contains(template, "/"):
		if _, err := image.ParseRef(template); err != nil {
			return "", err
		}
		return template, nil
	}
	name := "root/" + template + ":latest"
	if i := strings.IndexByte(template, ':'); i > 0 {
		name = "root/" + template
	}
	if _, err := image.ParseRef(name); err != nil {
		return "", errdefs.InvalidArgument("templateID %q: not a template this gateway knows (use \"base\" or an image name like \"root/py:3.11\")", template)
	}
	return name, nil
}
