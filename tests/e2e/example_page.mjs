// Drives examples/browser/index.html in headless Chromium with a fake microphone
// playing a WAV: presses Talk, waits for the reply to finish, then saves what the page
// received (its events, the audio track's RTP statistics) and a screenshot. Run inside
// a network namespace that holds only loopback (tests/test_examples.py does that).
//
//   node example_page.mjs URL WAV OUT_DIR
import { join } from "node:path";
import { launch, run } from "./chromium.mjs";

const [url, wav, out] = process.argv.slice(2);
const browser = await launch(wav);
const result = { ok: false, log: [] };
await run(browser, out, result, async () => {
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
});
