// Drives the browser demo in headless Chromium with a fake microphone playing a WAV,
// then saves what the page knows (window.duplexDemo, the received audio) and a
// screenshot. Run inside a network namespace that holds only loopback, with the server
// in it (tests/test_demo_e2e.py does both).
//
//   node demo.mjs URL WAV OUT_DIR [--until-turns N] [--close-after-audio-ms MS] [--timeout-s S]
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, wav, out, ...rest] = process.argv.slice(2);
const option = (name, fallback) => {
  const i = rest.indexOf(name);
  return i >= 0 ? Number(rest[i + 1]) : fallback;
};
const untilTurns = option("--until-turns", 1); // finished assistant turns to wait for
const closeAfterMs = option("--close-after-audio-ms", 0); // close the tab mid-reply instead
const timeoutMs = option("--timeout-s", 120) * 1000;

const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  headless: true,
  args: [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--allow-loopback-in-peer-connection",
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
    `--use-file-for-fake-audio-capture=${wav}%noloop`,
    "--autoplay-policy=no-user-gesture-required",
  ],
});
const result = { ok: false, log: [] };
try {
  const context = await browser.newContext({ permissions: ["microphone"], viewport: { width: 900, height: 900 } });
  const page = await context.newPage();
  page.on("console", (message) => result.log.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => result.log.push(`pageerror: ${error.message}`));
  await page.goto(url);
  await page.waitForFunction(() => window.duplexDemo && window.duplexDemo.connected, null, { timeout: 60000 });
  if (closeAfterMs) {
    await page.waitForFunction((ms) => window.duplexDemo.audioReceivedMs >= ms, closeAfterMs, { timeout: timeoutMs });
    result.demo = await snapshot(page);
    await page.close(); // the tab goes away mid-reply
  } else {
    await page.waitForFunction(
      (n) => window.duplexDemo.assistantTurns.filter((t) => t.status !== "in_progress").length >= n,
      untilTurns,
      { timeout: timeoutMs },
    );
    await page.waitForTimeout(1500); // the reply's last audio, and the page settles
    result.demo = await snapshot(page);
    result.stats = await page.evaluate(() => window.duplexDemo.stats && window.duplexDemo.stats());
    result.recording = await page.evaluate(() => window.duplexDemo.recording && window.duplexDemo.recording());
    await page.screenshot({ path: join(out, "page.png"), fullPage: true });
  }
  result.ok = true;
} catch (error) {
  result.error = String(error);
} finally {
  await browser.close();
  writeFileSync(join(out, "result.json"), JSON.stringify(result));
}

function snapshot(page) {
  return page.evaluate(() => {
    const { recording, ...rest } = window.duplexDemo;
    return { ...JSON.parse(JSON.stringify(rest)), cutShown: Boolean(document.querySelector("#conversation del")) };
  });
}
