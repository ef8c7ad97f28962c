/** Jest runs TypeScript through ts-jest; workflow and end-to-end tests share one Temporal dev server per file. */
module.exports = {
  testEnvironment: 'node',
  transform: { '^.+\\.ts$': 'ts-jest' },
  testMatch: ['<rootDir>/test/**/*.test.ts'],
  testTimeout: 300_000,
};
