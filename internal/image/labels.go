package image

// Labels an image's config can set to have a service started in every
// sandbox created from it [ours], as E2B's templates do with their start
// and ready commands. The edge runs the start command in the background
// once the sandbox's agent is up and answers the create only when the
// ready command has exited 0; a copy made by fork or restore already has
// the service running in its memory and runs neither.
const (
	LabelStart      = "org.opendsec.start"       // shell command (/bin/sh -c), run in the background
	LabelStartUser  = "org.opendsec.start.user"  // user both commands run as (default root)
	LabelReady      = "org.opendsec.ready"       // shell command that exits 0 once the service is ready
	LabelReadyLimit = "org.opendsec.ready.limit" // Go duration the ready check may take (default 60s)
)
