// On-policy distillation of the copy task: the same env as recipes/copy, but the actor trains on the teacher
// pool's per-token logprobs of what the student sampled (algo.advantage on_policy_distill, recipe key
// `teacher`), not on the reward. The reward (fraction of letters copied) is still recorded: it shows the
// student learning the task from the teacher alone. The loop is sync (on-policy): at this learning rate, tokens
// sampled a few versions back (the async loop) kept a random-init student from learning in a run seen here.
export { AgentRunner } from '../copy/agent';
