// Text <-> token ids for the agent boundary, from the model's own tokenizer.json with
// @huggingface/tokenizers (matches Python `tokenizers`; test/unit/tokenizer.test.ts checks it).
// Only observations and actions for the env are encoded/decoded here: sampled ids are never
// re-encoded (invariant 1).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { Tokenizer } from '@huggingface/tokenizers';

export class TextTokenizer {
  private constructor(private readonly tokenizer: Tokenizer, readonly config: Record<string, unknown>) {}

  static load(modelDir: string): TextTokenizer {
    const read = (name: string, required: boolean) => {
      const file = path.join(modelDir, name);
      if (!fs.existsSync(file)) {
        if (required) throw new Error(`tokenizer: ${file} does not exist (is ${modelDir} a HF model directory?)`);
        return {};
      }
      return JSON.parse(fs.readFileSync(file, 'utf8'));
    };
    const config = read('tokenizer_config.json', false);
    return new TextTokenizer(new Tokenizer(read('tokenizer.json', true), config), config);
  }

  // No BOS/EOS or template added: the caller decides every token of the sequence.
  encode(text: string): number[] {
    return this.tokenizer.encode(text, { add_special_tokens: false }).ids;
  }

  decode(ids: number[], skipSpecialTokens = false): string {
    return this.tokenizer.decode(ids, { skip_special_tokens: skipSpecialTokens, clean_up_tokenization_spaces: false });
  }

  tokenId(token: string): number | undefined {
    return this.tokenizer.token_to_id(token);
  }
}

const cache = new Map<string, TextTokenizer>();
export function tokenizerFor(modelDir: string): TextTokenizer {
  let t = cache.get(modelDir);
  if (!t) cache.set(modelDir, (t = TextTokenizer.load(modelDir)));
  return t;
}
