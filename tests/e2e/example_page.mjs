// Drives examples/browser/index.html in headless Chromium with a fake microphone
// playing a WAV: presses Talk, waits for the reply to finish, then saves what the page
// received (its events, the audio track's RTP statistics) and a screenshot. Run inside
// a network namespace that holds only loopback (tests/test_examples.py does that).
//
//   node example_page.mjs URL WAV OUT_DIR
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, wav, out] = process.argv.slice(2);
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
  const context = await browser.newContext({ permissions: ["microphone"] });
  const page = await context.newPage();
  page.on("console", (message) => result.log.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => result.log.push(`pageerror: ${error.message}`));
  await page.goto(url);
  await page.click("#talk"); // as a person would
  await page.waitForFunction(
    () => window.example.events.some((e) => e.type === "response.done"),
    null,
    { timeout: 120000 },
  );
  await page.waitForTimeout(1000); // the reply's last audio
  result.events = await page.evaluate(() => window.example.events);
  result.lines = await page.evaluate(() => [...document.querySelectorAll("#lines li")].map((li) => li.textContent));
  result.status = await page.textContent("#status");
  result.audio = await page.evaluate(async () => {
    const stats = await window.example.pc.getStats();
    const inbound = [...stats.values()].find((s) => s.type === "inbound-rtp" && s.kind === "audio");
    if (!inbound) return null;
    const { packetsReceived, bytesReceived, totalAudioEnergy, totalSamplesDuration } = inbound;
    return { packetsReceived, bytesReceived, totalAudioEnergy, totalSamplesDuration };
  });
  await page.screenshot({ path: join(out, "page.png"), fullPage: true });
  result.ok = true;
} catch (error) {
  result.error = String(error);
} finally {
  await browser.close();
  writeFileSync(join(out, "result.json"), JSON.stringify(result));
}
