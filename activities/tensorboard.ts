// TensorBoard event files, written as the run goes (recordMetrics appends one event per step), so
// `tensorboard --logdir <store>` shows every run live. An event file is a TFRecord stream:
//   u64 LE length | u32 LE masked crc32c(length bytes) | data | u32 LE masked crc32c(data)
// where data is a tensorflow.Event proto: wall_time (1, double), step (2, int64), and either
// file_version (3, string; the first record) or summary (5): Summary { value (1, repeated):
// Value { tag (1, string), simple_value (2, float) } }. Small enough to write here with protobufjs'
// Writer instead of a TensorFlow dependency in the worker.
import { promises as fs } from 'node:fs';
import * as path from 'node:path';
import { Writer } from 'protobufjs';

const CRC32C_TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0x82f63b78 ^ (c >>> 1) : c >>> 1; // Castagnoli, reflected
  return c >>> 0;
});
export function crc32c(bytes: Uint8Array): number {
  let crc = 0xffffffff;
  for (const b of bytes) crc = CRC32C_TABLE[(crc ^ b) & 0xff] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}
const masked = (crc: number) => ((((crc >>> 15) | (crc << 17)) >>> 0) + 0xa282ead8) >>> 0;

function record(data: Uint8Array): Buffer {
  const out = Buffer.alloc(data.length + 16);
  out.writeBigUInt64LE(BigInt(data.length), 0);
  out.writeUInt32LE(masked(crc32c(out.subarray(0, 8))), 8);
  out.set(data, 12);
  out.writeUInt32LE(masked(crc32c(data)), 12 + data.length);
  return out;
}

function event(wallTime: number, step: number, body: (w: Writer) => void): Buffer {
  const w = Writer.create().uint32((1 << 3) | 1).double(wallTime).uint32((2 << 3) | 0).int64(step);
  body(w);
  return record(w.finish());
}

// One event file per run: <runDir>/tensorboard/events.out.tfevents.molt (TensorBoard reads any file
// named events.out.tfevents.*). Created with its file_version record when missing.
export function eventFile(runDir: string): string {
  return path.join(runDir, 'tensorboard', 'events.out.tfevents.molt');
}

export async function appendScalars(
  runDir: string, step: number, scalars: Record<string, number>, wallTime = Date.now() / 1000,
): Promise<void> {
  const file = eventFile(runDir);
  await fs.mkdir(path.dirname(file), { recursive: true });
  const handle = await fs.open(file, 'a');
  try {
    const parts: Buffer[] = [];
    if ((await handle.stat()).size === 0) parts.push(event(wallTime, 0, (w) => w.uint32((3 << 3) | 2).string('brain.Event:2')));
    parts.push(event(wallTime, step, (w) => {
      w.uint32((5 << 3) | 2).fork();
      for (const [tag, value] of Object.entries(scalars)) {
        if (typeof value !== 'number' || !Number.isFinite(value)) continue;
        w.uint32((1 << 3) | 2).fork().uint32((1 << 3) | 2).string(tag).uint32((2 << 3) | 5).float(value).ldelim();
      }
      w.ldelim();
    }));
    await handle.appendFile(Buffer.concat(parts));
    await handle.sync();
  } finally {
    await handle.close();
  }
}
