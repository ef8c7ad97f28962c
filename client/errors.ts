// molt-client's exit codes: a usage error or a rejected value exits 2 (like a bad recipe config);
// a run or schedule that does not exist exits 1.
export class UsageError extends Error {}
export class RunNotFound extends Error {}
