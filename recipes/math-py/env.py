"""The math recipe (recipes/math) as an Env written in Python: Molt owns the LLM loop and drives
this program over JSON lines on stdin/stdout (molt_agent.serve_env). One turn: the policy reads the
problem and answers; reward 1 if the last \\boxed{} in its answer holds the right number."""
from arithmetic import boxed_answer, group_problem
from molt_agent import serve_env


class MathEnv:
    def __init__(self, settings):
        self.settings = settings
        self.problem = None

    def reset(self, task):
        self.problem = group_problem(task, self.settings)
        return f"Q: {self.problem.text} Put the answer in \\boxed{{}}.\nA:", {"answer": str(self.problem.answer)}

    def step(self, text, token_ids):
        reward = 1.0 if boxed_answer(text) == self.problem.answer else 0.0
        return None, reward, True, False, {"answer": str(self.problem.answer)}


if __name__ == "__main__":
    serve_env(MathEnv)
